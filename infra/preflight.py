"""`python -m infra.preflight [-c key=value …]`: check the AWS account against the platform config before
`cdk deploy`, with read-only calls (infra.account_checks) and the caller's credentials.

Reads the config as the CDK app does: cdk.json's context, overridden by the same `-c key=value` options given
to `cdk` (PlatformConfig.from_cdk_context). Prints one PASS/FAIL line per check, each failure with its fix, and
a summary. Exit code: 0 all passed, 1 a check failed, 2 bad usage, bad config or unusable credentials.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, NoReturn, Sequence

import boto3
from botocore.exceptions import ProfileNotFound

from infra.account_checks import CREDENTIAL_EXCEPTIONS, AwsClients, CheckResult, checks_for
from infra.config import ConfigError, PlatformConfig

CDK_JSON = Path(__file__).resolve().parent.parent / "cdk.json"
HOW_TO_GIVE_CREDENTIALS = ("give AWS credentials as for the AWS CLI: AWS_PROFILE=NAME (or --profile NAME), "
                           "`aws sso login`, or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY[/AWS_SESSION_TOKEN]")


class UsageError(Exception):
    """Bad command line, config or credentials: exit 2 with one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def read_config(overrides: Sequence[str], cdk_json: Path = CDK_JSON) -> PlatformConfig:
    """cdk.json's context with `-c key=value` overrides on top, as the CDK CLI hands them to app.py."""
    context = dict(json.loads(cdk_json.read_text()).get("context", {}))
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"-c {item!r}: expected key=value, e.g. -c gpuNodesDesired=4")
        context[key] = value
    return PlatformConfig.from_cdk_context(context)


def format_result(result: CheckResult) -> str:
    if result.ok:
        return f"PASS {result.name}: {result.detail}"
    return f"FAIL {result.name}: {result.detail} -- fix: {result.fix}"


def run(config: PlatformConfig, aws: AwsClients, out: Callable[[str], None] = print) -> bool:
    """Run every check that applies, printing each result as it comes; True when all passed."""
    results = []
    for check in checks_for(config):
        results.append(check(config, aws))
        out(format_result(results[-1]))
    failed = [r.name for r in results if not r.ok]
    if failed:
        out(f"preflight: {len(failed)} of {len(results)} checks failed ({', '.join(failed)}): fix them before "
            "`cdk deploy`")
    else:
        out(f"preflight: all {len(results)} checks passed for {config.cluster_name} in {config.region}: "
            "`npx cdk deploy --all` with the same -c options")
    return not failed


def main(argv: Sequence[str] | None = None,
         make_clients: Callable[[boto3.Session, str], AwsClients] = AwsClients.for_region) -> int:
    parser = _Parser(prog="python -m infra.preflight", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-c", "--context", action="append", default=[], metavar="KEY=VALUE",
                        help="a config value, as with `cdk -c` (repeat)")
    parser.add_argument("--profile", help="the AWS CLI profile to use (default: the usual credential chain)")
    try:
        args = parser.parse_args(argv)
        config = read_config(args.context)
        session = boto3.Session(profile_name=args.profile)
        return 0 if run(config, make_clients(session, config.region)) else 1
    except (UsageError, ConfigError, ProfileNotFound) as e:
        print(f"preflight: {e}", file=sys.stderr)
    except CREDENTIAL_EXCEPTIONS as e:
        print(f"preflight: no usable AWS credentials ({type(e).__name__}: {e}); {HOW_TO_GIVE_CREDENTIALS}",
              file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
