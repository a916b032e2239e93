"""The steer-name rule (vllm_steer/names.py): what a steer may be called, and how a name is
made from a file name."""

import pytest

from vllm_steer.names import (
    MAX_NAME_LENGTH, check_steer_name, echo, is_steer_name, safe_steer_name,
)


@pytest.mark.parametrize("name", ["detox", "smollm2-detox.v1", "A_b-9", "x" * MAX_NAME_LENGTH])
def test_valid_names(name):
    assert is_steer_name(name) and check_steer_name(name) == name


@pytest.mark.parametrize("name, fragment", [
    ("", "empty"), ("a,b:c d", "may use only ASCII"), ("detox=1", "may use only"),
    ("\uff15", "may use only"), (".", "'.' is reserved: as a file name it names a folder"),
    ("..", "'..' is reserved"), (7, "must be a string, got int"),
    ("x" * (MAX_NAME_LENGTH + 1), f"at most {MAX_NAME_LENGTH}"),
])
def test_invalid_names_say_why(name, fragment):
    assert not is_steer_name(name)
    with pytest.raises(ValueError, match=fragment) as e:
        check_steer_name(name)
    assert len(str(e.value)) < 200


def test_safe_names_from_file_names():
    assert safe_steer_name("my ckpt, v2") == "my-ckpt-v2"
    assert safe_steer_name("...") == "steer" and safe_steer_name("\uff15", "c") == "c"
    assert is_steer_name(safe_steer_name("y" * 500))


def test_echo_is_short():
    assert echo("x" * 10_000) == "'" + "x" * 40 + "'... (10000 characters)"
    assert len(echo(list(range(10_000)))) < 50 and echo("ab") == "'ab'"
