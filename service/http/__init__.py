"""The HTTP layer below the routes: the protocol the server runs, and the error answers.

    protocol.py  uvicorn's HTTP/1.1 protocol with bounded request heads and instant answers
    errors.py    ``ApiError`` and its subclasses, each one JSON error answer

May import: ``config`` only.
"""
