"""Who may do what on a node: loopback trust only for direct clients, the detailed view, mesh requests."""

from unittest import mock

from aiohttp.test_utils import make_mocked_request

from meshws.access import NodeAccess
from meshws.config import NodeSettings


def _request(remote: str, headers: dict[str, str] | None = None, path: str = "/mesh/join"):
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (remote, 4000) if name == "peername" else default
    return make_mocked_request("POST", path, headers={"Host": "127.0.0.1:8700", **(headers or {})},
                               transport=transport)


def test_without_a_secret_only_direct_loopback_clients_may_use_the_mesh_endpoints():
    access = NodeAccess(NodeSettings())
    assert access.authorize(_request("127.0.0.1"), b"") is None
    assert "loopback" in access.authorize(_request("10.0.0.9"), b"")
    assert "loopback" in access.authorize(_request("127.0.0.1", {"X-Forwarded-For": "203.0.113.9"}), b"")
    assert "loopback" in access.authorize(_request("127.0.0.1", {"Forwarded": "for=203.0.113.9"}), b"")
    assert "loopback" in access.authorize(_request("127.0.0.1", {"Host": "rebind.attacker.test"}), b"")
    assert "loopback" in access.authorize(_request("127.0.0.1", {"Host": "127.attacker.test:8700"}), b"")  # a name
    assert access.authorize(_request("127.0.0.1", {"Host": "[::1]:8700"}), b"") is None
    assert NodeAccess(NodeSettings(insecure=True)).authorize(_request("10.0.0.9"), b"") is None


def test_the_detailed_view_needs_a_direct_loopback_client_or_the_api_key():
    access = NodeAccess(NodeSettings(api_key="the-api-key"))
    assert access.detail_allowed(_request("127.0.0.1", path="/health"))
    assert not access.detail_allowed(_request("10.0.0.9", path="/health"))
    assert not access.detail_allowed(_request("127.0.0.1", {"X-Real-IP": "203.0.113.9"}, path="/health"))
    assert not access.detail_allowed(_request("127.0.0.1", {"Host": "rebind.attacker.test:8700"}, path="/health"))
    assert access.detail_allowed(_request("10.0.0.9", {"Authorization": "Bearer the-api-key"}, path="/health"))
    assert not access.detail_allowed(_request("10.0.0.9", {"Authorization": "Bearer guess"}, path="/health"))
