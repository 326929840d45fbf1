"""What the tests share: S3 servers and buckets (``s3``), small datasets (``datasets``,
``synthetic``), the service over its socket (``service``, ``workers``), byte-exact checks
under faults (``reliability``) and the command line (``cli``). The test folders mirror the
source: ``service/<room>/``, ``client/``, ``tools/``, ``core/`` (``shardfeed/`` itself),
``benchmarks/``, ``deploy/``."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository's root."""
