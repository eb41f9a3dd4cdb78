"""errors.map_errors: client exceptions become our BackendError types, chained, message kept."""

from __future__ import annotations

import pytest

from hicache_storage.errors import (
    BackendError,
    BackendTimeoutError,
    BackendUnavailableError,
    CapacityError,
    ErrorMap,
    InvalidArgumentError,
    map_errors,
    mapped_error,
)


class ClientError(Exception):
    """A client library's base exception."""


class ClientTimeout(ClientError):
    pass


class ClientReadTimeout(ClientTimeout):
    pass


MAPPING: ErrorMap = {
    ClientError: BackendError,
    ClientTimeout: BackendTimeoutError,
    ConnectionRefusedError: BackendUnavailableError,
}


def test_a_mapped_exception_is_reraised_as_the_mapped_type_from_the_original() -> None:
    original = ClientTimeout("server took 5 s")
    with pytest.raises(BackendTimeoutError) as info, map_errors(MAPPING):
        raise original
    assert str(info.value) == "server took 5 s"
    assert info.value.__cause__ is original
    assert type(info.value) is BackendTimeoutError


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (ClientReadTimeout, BackendTimeoutError),  # nearest mapped base in the MRO
        (ClientError, BackendError),
        (ConnectionRefusedError, BackendUnavailableError),
    ],
)
def test_the_most_specific_entry_wins_whatever_the_dict_order(
    raised: type[Exception], expected: type[BackendError]
) -> None:
    for mapping in (MAPPING, dict(reversed(list(MAPPING.items())))):
        with pytest.raises(expected) as info, map_errors(mapping):
            raise raised("x")
        assert type(info.value) is expected


def test_unmapped_exceptions_pass_unchanged() -> None:
    original = KeyError("k")
    with pytest.raises(KeyError) as info, map_errors(MAPPING):
        raise original
    assert info.value is original
    with pytest.raises(ConnectionResetError), map_errors(MAPPING):  # a sibling, not mapped
        raise ConnectionResetError("reset")


def test_our_own_errors_keep_their_type_under_a_broad_entry() -> None:
    broad: ErrorMap = {Exception: BackendError}
    for ours in (CapacityError("full"), InvalidArgumentError("bad key")):
        with pytest.raises(type(ours)) as info, map_errors(broad):
            raise ours
        assert info.value is ours


def test_no_exception_and_the_block_result() -> None:
    with map_errors(MAPPING):
        value = 41 + 1
    assert value == 42


def test_empty_message_becomes_the_class_name_and_decorator_use() -> None:
    @map_errors(MAPPING)
    def call() -> None:
        raise ClientTimeout()

    with pytest.raises(BackendTimeoutError, match=r"^ClientTimeout$"):
        call()


def test_mapped_error_returns_the_exception_itself_when_unmapped() -> None:
    exc = ValueError("v")
    assert mapped_error(exc, MAPPING) is exc
    new = mapped_error(ClientError("e"), MAPPING)
    assert type(new) is BackendError and new.__cause__ is not None
