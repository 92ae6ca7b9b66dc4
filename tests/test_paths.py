"""Per-flow paths: a plan names the path of a transfer (``Op.path``) and the network carries
it there (policy routing by source address, testbed/emulator/network.py); MultiTree's
switch-network variant (``variant: bfs``) names the paths it reserved."""

import dataclasses
import shutil
import subprocess
from collections import defaultdict

import pytest

from testbed.costmodel import predict
from testbed.plan import Op, Plan, PlanError, ProgramBuilder
from testbed.planners.multitree import plan_multitree
from testbed.routing import shortest_paths
from testbed.topogen import leaf_spine


def _strip(plan: Plan) -> Plan:
    """The same plan naming no path (the network's routing)."""
    p = Plan.from_dict(plan.to_dict())
    p.programs = {n: [dataclasses.replace(o, path=()) for o in prog] for n, prog in p.programs.items()}
    return p


def test_multitree_bfs_names_its_reserved_paths_and_the_cost_model_follows_them():
    """On a 4x4x4 leaf-spine fabric bfs reserves a path per message and step (288 of its 480
    connections' paths are not the static route); carried there the cost model predicts its
    15 steps well under the routed variant's 39, run on the static routes it would predict
    them slower (the finding this fixes)."""
    g = leaf_spine(4, 4, 4).graph()
    bfs, routed = plan_multitree(g, 1 << 18, variant="bfs"), plan_multitree(g, 1 << 18, variant="routed")
    bfs.validate()
    paths, static = bfs.paths(), shortest_paths(g)
    assert len(paths) == 480 and sum(list(p) != static[(a, b)] for (a, b, _), p in paths.items()) == 288
    assert not routed.paths() and not plan_multitree(g, 1 << 18, variant="bfs", channels="link").paths()
    on_paths, on_routes, r = (predict(p, g, tcp=True)["cct_s"] for p in (bfs, _strip(bfs), routed))
    assert on_paths < 0.5 * r < r < on_routes
    assert Plan.from_json(bfs.to_json()).paths() == paths
    assert "path" not in routed.to_dict()["programs"]["h0"][0]  # plans naming no path are as before


def test_a_path_must_join_sender_and_peer_and_one_connection_has_one():
    def plan(*paths_and_channels):
        b = ProgramBuilder(["a", "b", "s"])
        for i, (path, ch) in enumerate(paths_and_channels):
            b.transfer("a", "b", i, 1, reduce=False, path=path, channel=ch)
        return Plan("t", ["a", "b", "s"], 8, b.programs)

    plan((("a", "s", "b"), 0), (("a", "s", "b"), 0), ((), 1)).validate()
    bad = [([(("b", "s", "a"), 0)], "is not distinct known nodes"),
           ([(("a", "s", "s", "b"), 0)], "distinct"),
           ([(("a", "x", "b"), 0)], "known"),
           ([(("a", "s", "b"), 0), (("a", "b"), 0)], "one connection"),
           ([(("a", "s", "b"), 0), ((), 0)], "one connection")]
    for sends, why in bad:
        with pytest.raises(PlanError, match=why):
            plan(*sends).validate()
    recv = Plan("t", ["a", "b"], 8, {"a": [Op(0, "send", "b", 0, 0, 4)], "b": [Op(0, "recv", "a", 0, 0, 4, path=("b", "a"))]})
    with pytest.raises(PlanError, match="on a send"):
        recv.validate()


def _count_by_source(net, addrs) -> None:
    """An iptables rule per (datacenter's link interface, path address): counts what each
    path's connection sent over each link direction (forwarded or its own)."""
    for dc, h in net.hosts.items():
        rules = [f"-A POSTROUTING -o {d.intf} -s {a}/32" for (s, _), d in net.directions.items() if s == dc
                 for a in addrs]
        res = subprocess.run(["mnexec", "-a", str(h.pid), "iptables-restore", "--noflush"], text=True,
                             input="\n".join(["*mangle", *rules, "COMMIT"]) + "\n", capture_output=True)
        assert res.returncode == 0, res.stderr


def _counted(net) -> dict[tuple[str, str, str], int]:
    """(source address, link src, link dst) -> bytes counted."""
    intf = {d.intf: sd for sd, d in net.directions.items()}
    out = {}
    for dc, h in net.hosts.items():
        text = subprocess.run(["mnexec", "-a", str(h.pid), "iptables-save", "-c", "-t", "mangle"], text=True,
                              capture_output=True, check=True).stdout
        for line in text.splitlines():
            if line.startswith("[") and "-A POSTROUTING" in line:
                counts, _, rule = line.partition("] ")
                words = rule.split()
                src, out_if = words[words.index("-s") + 1].split("/")[0], words[words.index("-o") + 1]
                out[(src, *intf[out_if])] = int(counts.strip("[").split(":")[1])
    return out


@pytest.mark.net
def test_multitree_bfs_runs_contention_free_on_a_leaf_spine_fabric(netenv, tmp_path):
    """MultiTree bfs on an emulated 3-leaf, 2-spine fabric (6 hosts): the bytes sent from each
    path's address (its connections, which name it) cross exactly that path's links, counted
    per link (iptables), so in no step do two connections share a link; the result is exact."""
    if shutil.which("iptables-restore") is None:
        pytest.skip("iptables not installed (apt install iptables): the test counts each path's bytes per link with it")
    from testbed.emulator.hosts import EmulatedHosts
    from testbed.emulator.network import WanNetwork
    from testbed.hosts import run_agents

    topo = leaf_spine(3, 2, 2, rate_mbps=100)
    length = 600_000  # 100 000 elements, 400 KB a message
    plan = plan_multitree(topo.graph(), length, variant="bfs")
    paths = plan.paths()
    with WanNetwork(topo) as net:
        addr = net.install_paths(paths.values())
        _count_by_source(net, set(addr.values()))
        res = run_agents(EmulatedHosts(net), plan, tmp_path, timeout_s=60)
        counted = _counted(net)
    assert all(it["correct"] for it in res["iterations"])
    step = plan.meta["op_step"]
    by_step: dict[int, dict[tuple[str, str], list]] = defaultdict(lambda: defaultdict(list))
    for node, prog in plan.programs.items():
        for op in prog:
            if op.kind != "send" or len(op.path) < 3:
                continue
            crossed = {(a, b) for (src, a, b), n in counted.items() if src == addr[op.path] and n >= op.length * 4 / 2}
            assert crossed == set(zip(op.path, op.path[1:])), (node, op.peer, op.channel, op.path, crossed)
            for link in crossed:
                by_step[step[node][op.id]][link].append((node, op.peer, op.channel))
    assert by_step and all(len(c) == 1 for links in by_step.values() for c in links.values())
    assert len(addr) == len({p for p in paths.values() if len(p) >= 3}) > 0  # an address per path
