"""The training image: a given URI, or training/Dockerfile built and pushed as a CDK asset."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aws_cdk import aws_ecr_assets as ecr_assets
from constructs import Construct

# Build context = repository root (.dockerignore there keeps it to the training package).
REPO_ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = "training/Dockerfile"


@dataclass(frozen=True)
class TrainingImageProps:
    image_uri: str | None  # None: build DOCKERFILE at deploy time


class TrainingImage(Construct):
    """Resolves the image URI the training pods run; builds nothing at synthesis."""

    image_uri: str
    asset: ecr_assets.DockerImageAsset | None

    def __init__(self, scope: Construct, construct_id: str, props: TrainingImageProps) -> None:
        super().__init__(scope, construct_id)
        self.asset = None
        if props.image_uri:
            self.image_uri = props.image_uri
            return
        # Synthesis only fingerprints the context; Docker runs when `cdk deploy` publishes the asset.
        self.asset = ecr_assets.DockerImageAsset(
            self,
            "Asset",
            directory=str(REPO_ROOT),
            file=DOCKERFILE,
            platform=ecr_assets.Platform.LINUX_AMD64,  # GPU nodes are x86_64
        )
        self.image_uri = self.asset.image_uri
