"""GetBatch wire models: what the AIStore Python SDK 2.0.0 sends to and reads from ``/v1/ml/moss``.

Field names are AIStore's JSON tags (docs: the AIStore GetBatch protocol notes, section
2.3 and 4). Unknown keys are ignored, as AIStore's Go decoder does, so a newer SDK that
adds an optional field still works.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

PROVIDERS = {"": "ais", "ais": "ais", "aws": "aws", "s3": "aws"}
"""Providers accepted, and the name errors use for each (AIStore maps ``s3`` to ``aws``);
all of them mean the S3 endpoint shardfeed is configured with."""


class MossIn(BaseModel):
    """One requested entry; matches ``apc.MossIn`` in Go."""

    model_config = ConfigDict(extra="ignore")
    objname: StrictStr = Field(min_length=1, max_length=1024)
    bucket: StrictStr = Field("", max_length=255)
    provider: StrictStr = Field("", max_length=16)
    archpath: StrictStr = Field("", max_length=1024)
    opaque: StrictStr = Field("", max_length=4096, description="Echoed back, base64 as sent.")
    start: Annotated[StrictInt, Field(ge=0, lt=2**62)] = 0
    length: Annotated[StrictInt, Field(ge=-1, lt=2**62)] = 0


class MossReq(BaseModel):
    """The request body; matches ``apc.MossReq`` in Go."""

    model_config = ConfigDict(extra="ignore")
    # No minimum here: an empty list gets AIStore's own message ("moss: empty input").
    entries: list[MossIn] = Field(alias="in")
    mime: StrictStr = Field("", max_length=16)
    coer: StrictBool = False
    onob: StrictBool = False
    strm: StrictBool = False
    coloc: Annotated[StrictInt, Field(ge=0, le=2)] = 0


class MossOut(BaseModel):
    """One entry of the answer's metadata; matches ``apc.MossOut`` in Go."""

    objname: str
    bucket: str
    provider: str
    archpath: str = ""
    opaque: str = ""
    size: int = 0
    err_msg: str = ""


class MossResp(BaseModel):
    """The metadata part of a multipart answer; matches ``apc.MossResp`` in Go."""

    uuid: str
    out: list[MossOut]
