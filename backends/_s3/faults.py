"""How the ``s3`` backend tells S3's answers apart, and whose logs it scrubs.

An answer is worth a retry, or says the credentials are wrong, or maps to one of the SDK's
errors; the client's loggers get their records scrubbed of the backend's secrets.
"""

from __future__ import annotations

import asyncio

from hicache_storage.errors import (
    BackendError,
    BackendTimeoutError,
    BackendUnavailableError,
    ErrorMap,
)
from hicache_storage.secrets import LogScrubber

#: Error codes of answers worth asking again (throttling, a server's transient fault).
RETRY_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
    "TooManyRequestsException", "RequestTimeout", "RequestTimeTooSkewed", "InternalError",
    "ServiceUnavailable", "ConditionalRequestConflict", "503", "500", "502", "504", "409",
})  # fmt: skip


#: Error codes that mean the credentials, not the store, are wrong.
CREDENTIAL_CODES = frozenset({
    "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken",
    "ExpiredToken", "AuthorizationHeaderMalformed", "403",
})  # fmt: skip


def s3_error_map() -> ErrorMap:
    mapping: dict[type[BaseException], type[BackendError]] = {
        asyncio.TimeoutError: BackendTimeoutError,
        ConnectionError: BackendUnavailableError,
        PermissionError: BackendError,
        OSError: BackendUnavailableError,
    }
    try:
        from botocore import exceptions as bx
    except ImportError:  # pragma: no cover - the tests install it
        return mapping
    mapping.update({
        bx.ConnectTimeoutError: BackendTimeoutError,
        bx.ReadTimeoutError: BackendTimeoutError,
        bx.EndpointConnectionError: BackendUnavailableError,
        bx.HTTPClientError: BackendUnavailableError,
        bx.ClientError: BackendError,
        bx.BotoCoreError: BackendError,
    })  # fmt: skip
    return mapping


#: The S3 client's loggers. botocore logs request headers at DEBUG: the access key in
#: ``Authorization``, the session token, the SSE-C customer key (base64) and its MD5.
CLIENT_LOGGERS = ("botocore", "botocore.endpoint", "botocore.auth", "botocore.hooks",
                   "botocore.parsers", "botocore.retryhandler", "botocore.credentials",
                   "botocore.httpsession", "botocore.awsrequest", "botocore.client",
                   "botocore.utils", "botocore.regions", "botocore.handlers", "botocore.signers",
                   "botocore.httpchecksum", "aiobotocore", "aiobotocore.endpoint",
                   "aiobotocore.httpsession", "aiobotocore.credentials", "aiobotocore.client",
                   "aiobotocore.httpchecksum", "s3fs", "fsspec")  # fmt: skip


#: Cuts live backends' secrets out of those loggers' records.
LOG_SCRUB = LogScrubber()


def error_code(exc: BaseException) -> str:
    """The S3 error code of ``exc`` or of what caused it ("" when it has none)."""
    seen: BaseException | None = exc
    for _ in range(6):
        if seen is None:
            return ""
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            code = str(error.get("Code") or "")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return code or (str(status) if status else "")
        seen = seen.__cause__ or seen.__context__
    return ""


def is_transient(exc: BaseException) -> bool:
    """True if ``exc`` is worth a retry: throttling, a 5xx, a dropped connection."""
    if error_code(exc) in RETRY_CODES:
        return True
    try:
        from botocore import exceptions as bx
    except ImportError:  # pragma: no cover
        return False
    seen: BaseException | None = exc
    for _ in range(6):
        if seen is None:
            return False
        if isinstance(seen, (bx.HTTPClientError, bx.ConnectionError, asyncio.TimeoutError)):
            return True
        name = type(seen).__name__
        if name in ("ClientPayloadError", "ServerDisconnectedError", "ClientOSError"):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
