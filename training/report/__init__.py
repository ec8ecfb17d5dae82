"""`python -m training.report RUN_DIR`: goodput figures (`goodput`, a pure function of the event log) and the
timeline picture (`plot`)."""
