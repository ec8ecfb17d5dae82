"""`python -m training.plan`: the checkpoint-interval planner (`planner`)."""
