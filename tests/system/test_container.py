"""The Docker image (issue 65): built with podman from a plain Debian base, a head and a tail from it answer on
meshws's kernels.

Marked slow (minutes: a base made with debootstrap, then torch and meshws installed into the image) and run only
where podman, runc and debootstrap are installed: `./dev test -m slow tests/system/test_container.py` as root. It
makes the base `localhost/debian-py:bookworm` unless one is there (and then removes it again), builds the image
through this machine's pip configuration (its `PIP_*` variables, /etc/pip.conf and the folder of wheels
`PIP_FIND_LINKS` names, read-only: torch's CPU build comes from there), starts the two containers on loopback
ports with a secret, and removes every container, volume and image it made.
"""

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from helpers import SECRET, chat_ids, complete_ids, golden
from meshws.tools.launch import free_port

pytestmark = [pytest.mark.slow, pytest.mark.real_model, pytest.mark.processes,
              pytest.mark.skipif(not all(shutil.which(tool) for tool in ("podman", "runc", "debootstrap"))
                                 or os.geteuid() != 0, reason="needs podman, runc and debootstrap, as root")]

ROOT = Path(__file__).resolve().parents[2]
BASE = "localhost/debian-py:bookworm"
MIRROR = os.environ.get("MESHWS_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# What podman needs on these machines: runc (crun refuses hybrid cgroups), explicit limits, the host's network.
PODMAN = ["--runtime", "runc", "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096", "--network", "host"]


def _podman(*args, timeout=1800, check=True):
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode:
        raise AssertionError(f"podman {' '.join(args[:3])}... failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done


@pytest.fixture(scope="module")
def base():
    """A Debian bookworm with python3, venv, pip and gcc: made with debootstrap unless it is there."""
    if _podman("image", "exists", BASE, check=False).returncode == 0:
        yield BASE
        return
    with tempfile.TemporaryDirectory(dir="/var/tmp") as folder:
        root = Path(folder) / "root"
        subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,python3-pip,gcc,libc6-dev",
                        "bookworm", str(root), MIRROR], check=True, capture_output=True, timeout=1800)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["podman", "import", "-", BASE], stdin=tar.stdout, check=True, capture_output=True,
                       timeout=600)
        tar.wait()
    yield BASE
    _podman("rmi", "-f", BASE, check=False)


@pytest.fixture(scope="module")
def image(base):
    tag = f"localhost/meshws-test:{uuid.uuid4().hex[:8]}"
    mounts = ["-v", "/etc/pip.conf:/etc/pip.conf:ro", "-v", "/etc/ssl/certs:/etc/ssl/certs:ro"]
    wheels = os.environ.get("PIP_FIND_LINKS", "")
    for folder in wheels.split():
        if Path(folder).is_dir():
            mounts += ["-v", f"{folder}:{folder}:ro"]
    passed = [arg for name in os.environ if name.startswith("PIP_") for arg in ("--env", name)]
    _podman("build", *PODMAN, "--format", "docker", *mounts, *passed, "--build-arg", f"BASE={base}",
            "--build-arg", "TORCH_INDEX=", "-t", tag, str(ROOT))
    yield tag
    _podman("rmi", "-f", tag, check=False)


def _health(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
        return json.loads(response.read())


def _run(image, name, secret, **env):
    variables = [arg for key, value in {"MESHWS_SECRET_FILE": "/run/mesh.secret", "MESHWS_HOST": "127.0.0.1",
                                        "MESHWS_DTYPE": "float32", **env}.items()
                 for arg in ("-e", f"{key}={value}")]
    _podman("run", "-d", *PODMAN, "--name", name, "-v", f"{secret}:/run/mesh.secret:ro", *variables, image)


def test_a_head_and_a_tail_from_the_image_answer_on_meshws_kernels(image, tmp_path, tokenizer, reference_model):
    size = int(_podman("image", "inspect", image, "--format", "{{.Size}}").stdout.strip())
    print(f"image {image}: {size / 2**30:.2f} GiB")
    assert size < 3 * 2**30  # torch's CPU build: the CUDA one alone is larger
    secret = tmp_path / "mesh.secret"
    secret.write_text(SECRET + "\n")
    secret.chmod(0o644)  # (read by the image's user, 10001)
    head_port, tail_port = free_port(), free_port()
    names = [f"meshws-test-head-{head_port}", f"meshws-test-tail-{tail_port}"]
    try:
        _run(image, names[0], secret, MESHWS_ROLE="head", MESHWS_LAYERS="0-14", MESHWS_PORT=head_port)
        _run(image, names[1], secret, MESHWS_ROLE="tail", MESHWS_LAYERS="15-29", MESHWS_PORT=tail_port,
             MESHWS_ADVERTISE=f"ws://127.0.0.1:{tail_port}", MESHWS_JOIN=f"http://127.0.0.1:{head_port}")
        deadline = time.monotonic() + 300  # (each container builds the kernels for this CPU if the image's differ)
        while True:
            try:
                if _health(head_port)["ready"]:
                    break
            except OSError:
                pass
            logs = "".join(_podman("logs", name, check=False).stdout[-2000:] for name in names)
            assert time.monotonic() < deadline, logs
            time.sleep(1)
        for port in (head_port, tail_port):
            health = _health(port)
            assert health["compute"]["path"].startswith("lean llama, GGUF blocks"), health["compute"]
            assert health["identity"]["fingerprint"]  # (a key made in the container's cache volume)
        ids = chat_ids(tokenizer, "What is the capital of France?")
        import asyncio

        tokens, _ = asyncio.run(complete_ids(f"http://127.0.0.1:{head_port}", ids, 12))
        assert tokens == golden(reference_model, ids, 12)
    finally:
        for name in names:
            _podman("rm", "-f", "-v", name, check=False)
