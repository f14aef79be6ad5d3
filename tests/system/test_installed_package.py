"""A plain `pip install .` (not editable) in its own venv gives a working `meshws` command and node.

`./dev installed` builds `.venv-installed` once (torch, the project's dependencies, the
model package) and reinstalls this checkout's wheel on later runs. The node runs from
another folder, so nothing can come from the repository by accident.
"""

import json
import subprocess
import time
import urllib.request

import pytest

from helpers import MODEL, ROOT
from meshws.tools.launch import free_port

pytestmark = [pytest.mark.real_model, pytest.mark.processes]


@pytest.fixture(scope="module")
def bin_dir(embedded_model):
    result = subprocess.run([str(ROOT / "dev"), "installed"], capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def test_the_installed_command_starts_a_node_that_serves_the_page_and_the_api(bin_dir, tmp_path):
    meshws = f"{bin_dir}/meshws"
    version = subprocess.run([meshws, "--version"], capture_output=True, text=True, cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("meshws 0.")
    helped = subprocess.run([meshws, "node", "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert helped.returncode == 0 and "usage: meshws node" in helped.stdout and "--role" in helped.stdout
    where = subprocess.run([f"{bin_dir}/python", "-c", "import meshws; print(meshws.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert "site-packages" in where.stdout and str(ROOT / "meshws") not in where.stdout

    port = free_port()
    log = tmp_path / "node.log"
    with log.open("w") as out:
        node = subprocess.Popen([meshws, "node", "--role", "full", "--port", str(port), "--threads", "1"],
                                cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "ready:" not in log.read_text():
            assert node.poll() is None, "the installed node exited:\n" + log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the installed node did not start:\n" + log.read_text()[-3000:]
            time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as response:
            assert b"meshws chat" in response.read()
        for name in ("chat.js", "chat.css", "code.css"):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/static/{name}", timeout=10) as response:
                assert response.status == 200, name
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}],
                           "max_tokens": 8, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        assert answer["choices"][0]["message"]["content"].strip()
        assert answer["usage"]["completion_tokens"] > 0
    finally:
        node.terminate()
        assert node.wait(30) == 0
