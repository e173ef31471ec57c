"""The console when its audit index cannot be opened (here: its path is taken by a directory): search and
stats answer 503 `index_unavailable` with a sentence, the rest of the console and the admin API go on.
A real AdminServer on a real socket (real audit sink, memory state), driven over HTTP."""

from __future__ import annotations

import httpx

from egressgate.admin.server import AdminServer
from egressgate.audit.config import open_audit_sink
from egressgate.config import load_config
from egressgate.gateway.shared.context import PolicyHolder, Runtime
from egressgate.state.memory import MemoryState


async def test_search_and_stats_fail_closed_when_the_index_cannot_open(tmp_path):
    var = tmp_path / "var"
    cfg = load_config(None, {"var_dir": str(var), "policy": str(tmp_path)})
    sink = await open_audit_sink(cfg.audit, var)
    (var / "audit.jsonl.index.sqlite").mkdir()  # nothing can open a database there
    rt = Runtime(config=cfg, policies=PolicyHolder({}), state=MemoryState(), audit=sink,
                 resolver=None, ledger=None)  # type: ignore[arg-type]  # the console uses neither
    server = AdminServer(rt, "t" * 32)
    host, port = await server.start("127.0.0.1", 0)
    base = f"http://{host}:{port}"
    try:
        async with httpx.AsyncClient(base_url=base, trust_env=False, timeout=10) as c:
            token = (var / "console-auditor.token").read_text().strip()
            login = await c.post("/ui/api/login", json={"token": token}, headers={"Origin": base})
            assert login.status_code == 200, login.text  # login itself does not depend on the index
            for path in ("/ui/api/search?sandbox=x", "/ui/api/stats"):
                res = await c.get(path)
                assert res.status_code == 503 and res.json()["error"] == "index_unavailable", res.text
                assert res.headers["content-security-policy"].startswith("default-src 'none'")
            assert (await c.get("/ui/api/sandboxes")).status_code == 200
            assert (await c.get("/healthz")).status_code == 200
    finally:
        await server.stop()
        await sink.close()
