"""Strict JSON bodies: what is refused, with which status, before anything reaches a model."""

import asyncio

import pytest

from omnigraph.plugin.api.body import BodyError, check_content_type, parse_strict_json, read_capped


def _refused(call, *args) -> BodyError:
    with pytest.raises(BodyError) as caught:
        call(*args)
    return caught.value


def test_plain_json_parses():
    assert parse_strict_json(b'{"state": "caf\xc3\xa9 \\ud83d\\ude00", "n": [1, 2.5, null]}') == {
        "state": "café 😀", "n": [1, 2.5, None]}


@pytest.mark.parametrize("raw", [b'{"x": NaN}', b'{"x": Infinity}', b'[-Infinity]'])
def test_non_finite_numbers_are_400(raw):
    error = _refused(parse_strict_json, raw)
    assert error.status == 400 and "not valid JSON" in error.message


def test_duplicate_keys_are_400_and_named():
    error = _refused(parse_strict_json, b'{"questions": {}, "state": "a", "state": "b"}')
    assert error.status == 400 and "'state'" in error.message


@pytest.mark.parametrize("raw", [b'{"state": "\\ud800"}', b'{"\\udfff": 1}', b'["ok", {"a": ["x\\ud83d"]}]'])
def test_lone_surrogates_are_400(raw):
    assert _refused(parse_strict_json, raw).status == 400


def test_invalid_utf8_is_400():
    error = _refused(parse_strict_json, b'{"state": "\xff\xfe"}')
    assert error.status == 400 and error.code == "invalid_utf8"


@pytest.mark.parametrize("raw", [b"", b"{", b'{"a": 1} trailing', b"[" * 100000 + b"]" * 100000])
def test_malformed_json_is_400(raw):
    assert _refused(parse_strict_json, raw).status == 400


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/vnd.api+json"])
def test_json_content_types_pass(content_type):
    check_content_type(content_type)


@pytest.mark.parametrize("content_type", [None, "", "text/plain", "application/x-www-form-urlencoded",
                                          "application/json; charset=latin-1"])
def test_other_content_types_are_415(content_type):
    assert _refused(check_content_type, content_type).status == 415


async def _chunks(sizes):
    for size in sizes:
        yield b"x" * size


def _read(sizes, content_length, limit):
    return asyncio.run(read_capped(_chunks(sizes), content_length, limit))


def test_body_within_the_cap_is_read_whole():
    assert _read([3, 4], "7", 8) == b"x" * 7


def test_a_claimed_length_over_the_cap_is_413_before_reading():
    assert _refused(_read, [], "9", 8).status == 413


@pytest.mark.parametrize("content_length", [None, "2"])
def test_the_counted_length_is_what_counts(content_length):
    # No Content-Length, or one that lies: the bytes actually received are counted.
    assert _refused(_read, [5, 5], content_length, 8).status == 413


def test_a_content_length_that_is_not_a_number_is_400():
    assert _refused(_read, [1], "ten", 8).status == 400
