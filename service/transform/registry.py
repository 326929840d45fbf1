"""The served transforms: what ``serve --transform NAME=MODULE:FACTORY`` registered, by name.

Each is loaded here once (its module imported, its factory called, its outputs checked), for what
the service says of it (``GET /v1/transforms``, an answer's headers) and keys its prepared
outputs by (its ``version``); the pool's processes load their own copies from the same spec.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardfeed.service.config import ServiceConfig, transform_specs
from shardfeed.transforms.base import Transform, describe, load


@dataclass(frozen=True)
class ServedTransform:
    """One registered transform: its name, the spec it was loaded from, itself, and what
    ``describe`` says of it (version, fields, outputs)."""

    name: str
    spec: str
    transform: Transform
    description: dict

    @property
    def version(self) -> str:
        return self.description["version"]

    def listed(self) -> dict:
        """Its entry in ``GET /v1/transforms``: the spec lets a client load the same transform locally."""
        return {"name": self.name, "spec": self.spec, **self.description}


class Transforms:
    """The served transforms, by name (none: the service runs no pool)."""

    def __init__(self, specs: dict[str, str]):
        self.specs = dict(specs)
        self.served: dict[str, ServedTransform] = {}
        for name, spec in specs.items():
            transform = load(spec)
            self.served[name] = ServedTransform(name, spec, transform, describe(transform))

    @classmethod
    def of(cls, config: ServiceConfig) -> Transforms:
        return cls(transform_specs(config.transforms))

    def __bool__(self) -> bool:
        return bool(self.served)

    def get(self, name: str) -> ServedTransform | None:
        return self.served.get(name)

    def listed(self) -> list[dict]:
        return [served.listed() for served in self.served.values()]


def pool_processes(config: ServiceConfig) -> int:
    """This process's share of ``--transform-processes``: with ``--workers N`` each worker runs its
    own pool (a transformed batch is served by the worker that receives it), of an N-th of them."""
    workers = len(config.worker.ports) if config.worker is not None else 1
    return max(1, config.transform_processes // workers)
