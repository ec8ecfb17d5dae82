#!/usr/bin/env python3
"""CDK entry point: read the platform config from context, build the stacks, synthesize."""
import aws_cdk as cdk

from infra.config import PlatformConfig
from infra.platform import build_platform

app = cdk.App()
config = PlatformConfig.from_context(app.node.try_get_context)
build_platform(app, config)
app.synth()
