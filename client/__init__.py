"""The shardfeed client: fetch samples and batches from a shardfeed service.

    from shardfeed.client import Client
    client = Client("http://127.0.0.1:8080")
    batch = client.get_batch("train", [17, 4, 9])   # one request, samples in that order

``AsyncClient`` is the asyncio twin. The PyTorch datasets live in
``shardfeed.client.torch`` (imported on demand, so the client does not need torch), and
batches as one uint8 tensor (``Client.get_batch_tensors``, ``output="tensors"``) in
``shardfeed.client.tensors``.
"""

from .aio import AsyncClient
from .errors import ShardfeedConnectionError, ShardfeedError, ShardfeedHTTPError
from .samples import MISSING
from .sync import Client

__all__ = [
    "MISSING",
    "AsyncClient",
    "Client",
    "ShardfeedConnectionError",
    "ShardfeedError",
    "ShardfeedHTTPError",
]
