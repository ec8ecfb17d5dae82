#!/usr/bin/env python3
"""CDK entry point: read the platform config from context, build the stacks, synthesize."""
import os
import sys

# The jsii runtime under aws-cdk-lib prints a Node 20 end-of-life banner on every start: known noise that
# would bury a config error's one line (k8s/main.py silences it the same way).
os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")

import aws_cdk as cdk  # noqa: E402  (needs the environment above)

from infra.config import ConfigError, PlatformConfig  # noqa: E402
from infra.platform import build_platform  # noqa: E402

app = cdk.App()
try:
    config = PlatformConfig.from_cdk_context(app.node.get_all_context())
except ConfigError as err:
    # A bad -c value or cdk.json entry is the user's to fix: its message (key, value, what is allowed) and a
    # non-zero exit, as `python k8s/main.py` answers it, not a traceback around it.
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
build_platform(app, config)
app.synth()
