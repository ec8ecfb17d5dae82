#!/usr/bin/env python3
"""CDK entry point: read the platform config from context, build the stacks, synthesize."""
import aws_cdk as cdk

from infra.config import PlatformConfig
from infra.platform import build_platform

app = cdk.App()
config = PlatformConfig.from_cdk_context(app.node.get_all_context())
build_platform(app, config)
app.synth()
