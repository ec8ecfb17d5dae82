"""One cdk8s Chart per concern; each takes the JobConfig as its props."""
