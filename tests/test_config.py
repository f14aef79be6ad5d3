"""Command line and MESHWS_* variables."""

import subprocess
import sys

import pytest

from meshws.config import NodeSettings, parse_layers, parse_settings, parse_size, settings_fields


def test_flags_parse_into_settings_with_inclusive_layers():
    settings = parse_settings(["--role", "tail", "--layers", "15-29", "--port", "8702", "--max-cache-bytes", "2G",
                               "--peer", "http://10.0.0.2:8703"], environ={})
    assert settings.role == "tail"
    assert settings.layers == (15, 30)  # half-open in code
    assert settings.port == 8702
    assert settings.max_cache_bytes == 2 * 1024**3
    assert settings.peer == "ws://10.0.0.2:8703"
    assert settings.host == "127.0.0.1"


def test_every_flag_has_an_environment_variable_and_flags_win():
    environ = {"MESHWS_ROLE": "middle", "MESHWS_LAYERS": "10-19", "MESHWS_PEER": "ws://x:1", "MESHWS_PORT": "9000",
               "MESHWS_CACHE_TTL": "30", "MESHWS_DTYPE": "float32", "MESHWS_API_KEY": "k"}
    settings = parse_settings([], environ=environ)
    assert (settings.role, settings.layers, settings.port, settings.cache_ttl, settings.dtype, settings.api_key) == (
        "middle", (10, 20), 9000, 30.0, "float32", "k")
    assert parse_settings(["--port", "9100"], environ=environ).port == 9100
    help_text = subprocess.run([sys.executable, "-m", "meshws.node", "--help"], capture_output=True, text=True).stdout
    for name in settings_fields():
        if name != "extra":
            assert "--" + name.replace("_", "-") in help_text
            assert "MESHWS_" + name.upper() in help_text


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--role", "middle", "--layers", "5-14"], "needs --peer"),
        (["--role", "tail", "--layers", "auto"], "--layers auto is for"),
        (["--role", "full", "--layers", "auto"], "--layers auto is for"),
        (["--role", "auto", "--layers", "4-9", "--join", "http://h:1"], "--role auto takes its role"),
        (["--role", "auto", "--layers", "auto"], "--role auto takes its role"),
        (["--role", "auto", "--layers", "auto", "--join", "http://h:1", "--memory", "100K"], "--memory must be"),
        (["--role", "full", "--join", "http://h:1"], "only middle, tail and auto"),
        (["--role", "tail"], "needs --layers"),
        (["--role", "head", "--layers", "3-14", "--peer", "ws://x:1"], "starts at layer 0"),
        (["--role", "full", "--peer", "ws://x:1"], "takes no --peer"),
        (["--role", "tail", "--layers", "9-3"], "ends before it starts"),
        (["--role", "king"], "invalid choice"),
    ],
)
def test_bad_settings_are_refused_with_a_reason(argv, needle, capsys):
    with pytest.raises(SystemExit):
        parse_settings(argv, environ={})
    assert needle in capsys.readouterr().err


def test_bad_environment_value_names_the_variable(capsys):
    with pytest.raises(SystemExit):
        parse_settings([], environ={"MESHWS_PORT": "eighty"})
    assert "MESHWS_PORT" in capsys.readouterr().err


def test_sizes_and_layers():
    assert parse_size("512") == 512
    assert parse_size("64M") == 64 * 1024**2
    assert parse_size("1.5GiB") == int(1.5 * 1024**3)
    assert parse_layers("0-14") == (0, 15)
    assert NodeSettings().host == "127.0.0.1"


def test_secrets_come_from_files_and_short_ones_are_refused(tmp_path, capsys):
    secret, key = tmp_path / "mesh.secret", tmp_path / "api.key"
    secret.write_text("a-secret-of-sixteen-bytes\n")
    key.write_text("the-api-key\n")
    settings = parse_settings(["--secret-file", str(secret), "--api-key-file", str(key)], environ={})
    assert settings.secret == "a-secret-of-sixteen-bytes" and settings.api_key == "the-api-key"
    assert parse_settings([], environ={"MESHWS_SECRET_FILE": str(secret)}).secret == "a-secret-of-sixteen-bytes"
    (tmp_path / "empty").write_text("\n")
    for argv, needle in ((["--secret-file", str(tmp_path / "missing")], "missing"),
                         (["--secret-file", str(tmp_path / "empty")], "empty"),
                         (["--secret", "too-short"], "at least 16 bytes"),
                         (["--host", "0.0.0.0"], "--insecure"),
                         (["--host", "127.attacker.test"], "--insecure"),  # a name is not loopback
                         (["--tls-cert", "x.pem"], "--tls-key")):
        with pytest.raises(SystemExit):
            parse_settings(argv, environ={})
        assert needle in capsys.readouterr().err
    assert parse_settings(["--host", "0.0.0.0", "--insecure"], environ={}).insecure
    assert parse_settings(["--host", "0.0.0.0"], environ={"MESHWS_INSECURE": "1"}).insecure


@pytest.mark.parametrize("dtype, wire, sent", [
    ("float32", "auto", "float32"),  # an exact node sends what it computes: a split answers as one machine
    ("bfloat16", "auto", "bfloat16"),
    ("auto", "auto", "bfloat16"),  # a GGUF's 8-bit activations lose more than bf16 links do
    ("float32", "bfloat16", "bfloat16"),  # asked for: kept
])
def test_the_wire_dtype_follows_the_compute_dtype_unless_asked_for(dtype, wire, sent):
    from meshws.model.settings import ShardSettings

    assert parse_settings([], environ={}).wire_dtype == "auto"
    assert ShardSettings(dtype=dtype, wire_dtype=wire).checked()[0].wire_dtype == sent
