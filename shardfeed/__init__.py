"""shardfeed: batched, ordered sample loading from S3-compatible storage.

The distribution maps the repository's top-level folders to subpackages:
``service/`` -> ``shardfeed.service``, ``client/`` -> ``shardfeed.client``,
``seeds/`` -> ``shardfeed.seeds``, ``benchmarks/`` -> ``shardfeed.benchmarks``.
"""

__version__ = "0.1.0"
