"""The bounds ``elr serve`` puts on a request by default, shared by its command line and its API."""

#: Default ``--body_timeout``: seconds a client has to send its whole request body.
DEFAULT_BODY_TIMEOUT_S = 30.0

#: Default ``--max_request_bytes``: 4 MiB, room for a 131,072-token prompt of plain text.
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
