"""Cost model: flow-level max-min fair simulation and the α-β estimate (testbed/costmodel.py)."""

from __future__ import annotations

import time

import networkx as nx
import pytest

from testbed.costmodel import alpha_beta, max_min_rates, predict
from testbed.plan import Op, Plan, PlanError, ProgramBuilder
from testbed.planners import make_plan
from testbed.routing import shortest_paths


def build(edges, rate=100.0, delay=10.0) -> nx.DiGraph:
    g = nx.DiGraph()
    for u, v in edges:
        g.add_edge(u, v, rate_mbps=rate, delay_ms=delay)
        g.add_edge(v, u, rate_mbps=rate, delay_ms=delay)
    return g


def ring_graph(n, rate=100.0, delay=10.0):
    return build([(f"n{i}", f"n{(i + 1) % n}") for i in range(n)], rate, delay)


def path_graph(n, rate=100.0, delay=10.0):
    return build([(f"n{i}", f"n{i + 1}") for i in range(n - 1)], rate, delay)


def Bps(mbps):
    return mbps * 1e6 / 8


def manual(nodes, transfers, length=1000):
    """Plan from (src, dst, channel) triples, all independent."""
    b = ProgramBuilder(nodes)
    for src, dst, ch in transfers:
        b.transfer(src, dst, 0, length, reduce=False, channel=ch)
    return Plan("manual", list(nodes), length, b.programs)


def test_single_transfer_is_delay_plus_size_over_rate():
    g = build([("a", "b")], rate=80, delay=10)
    r = predict(manual(["a", "b"], [("a", "b", 0)], 1000), g, elem_bytes=4)
    assert r["cct_s"] == pytest.approx(0.010 + 4000 / Bps(80), rel=1e-12)
    assert r["model"] == "flow-level max-min fair"
    assert r["per_link_bytes"] == {"a->b": 4000}
    assert r["bottleneck"] == "a->b"


def test_multi_hop_transfer_uses_routed_path():
    g = build([("a", "b"), ("b", "c")], rate=100, delay=5)
    g["b"]["c"]["rate_mbps"] = 20
    r = predict(manual(["a", "b", "c"], [("a", "c", 0)], 10_000), g)
    assert r["cct_s"] == pytest.approx(0.010 + 40_000 / Bps(20), rel=1e-12)
    assert r["per_link_bytes"] == {"a->b": 40_000, "b->c": 40_000}
    assert r["bottleneck"] == "b->c"


def test_two_flows_on_one_link_take_twice_as_long():
    g = build([("a", "b")], rate=100, delay=10)
    one = predict(manual(["a", "b"], [("a", "b", 0)], 10_000), g)["cct_s"]
    two = predict(manual(["a", "b"], [("a", "b", 0), ("a", "b", 1)], 10_000), g)["cct_s"]
    xfer = 40_000 / Bps(100)
    assert one == pytest.approx(0.01 + xfer)
    assert two == pytest.approx(0.01 + 2 * xfer)
    # two different sources converging on one link b->c
    g3 = build([("a", "b"), ("b", "c")], rate=100, delay=10)
    conv = predict(manual(["a", "b", "c"], [("a", "c", 0), ("b", "c", 0)], 10_000), g3)
    assert conv["node_finish_s"]["c"] == pytest.approx(0.02 + 2 * xfer)


def test_fifo_connection_serialises_transfers():
    g = build([("a", "b")], rate=100, delay=10)
    plan = manual(["a", "b"], [("a", "b", 0), ("a", "b", 0)], 10_000)
    r = predict(plan, g)
    xfer = 40_000 / Bps(100)
    assert r["cct_s"] == pytest.approx(0.01 + 2 * xfer)
    # the α-β estimate keeps the stream order but no cross-connection contention
    assert alpha_beta(plan, g)["cct_s"] == pytest.approx(0.01 + 2 * xfer)
    par = manual(["a", "b"], [("a", "b", 0), ("a", "b", 1)], 10_000)
    assert alpha_beta(par, g)["cct_s"] == pytest.approx(0.01 + xfer)


def test_max_min_fairness_progressive_filling():
    # link 0 (cap 10) carries f1 and f2, link 1 (cap 100) carries f2 and f3
    rates = max_min_rates({(0,): 1, (0, 1): 1, (1,): 1}, [10.0, 100.0])
    assert rates == {(0,): 5.0, (0, 1): 5.0, (1,): 95.0}
    rates = max_min_rates({(0,): 3}, [9.0])
    assert rates == {(0,): 3.0}


@pytest.mark.parametrize("n", [4, 6, 9])
def test_ring_matches_textbook(n):
    alpha, rate, length = 0.015, 100.0, 300_000
    g = ring_graph(n, rate=rate, delay=alpha * 1000)
    plan = make_plan("ring", g, length)
    S = length * 4
    textbook = 2 * (n - 1) * (alpha + S / (n * Bps(rate)))
    r = predict(plan, g)
    assert r["cct_s"] == pytest.approx(textbook, rel=0.01)
    assert alpha_beta(plan, g)["cct_s"] == pytest.approx(textbook, rel=0.01)
    # each ring link carries 2(n-1) blocks of S/n
    assert sum(r["per_link_bytes"].values()) == pytest.approx(n * 2 * (n - 1) * S / n, rel=1e-3)


def test_pipelined_tree_beats_unpipelined_on_path():
    g = path_graph(6, rate=100, delay=5)
    length = 1_000_000
    t1 = predict(make_plan("mst", g, length, {"chunks": 1}), g)["cct_s"]
    t8 = predict(make_plan("mst", g, length, {"chunks": 8}), g)["cct_s"]
    assert t8 < 0.5 * t1
    # unpipelined reduce+broadcast over a height-l tree: 2l(α + S/B)  (MTREE §I)
    plan = make_plan("mst", g, length, {"chunks": 1, "root": "n0"})
    assert predict(plan, g)["cct_s"] == pytest.approx(2 * 5 * (0.005 + 4e6 / Bps(100)), rel=1e-9)
    # pipelined along the path, uniform links: (2l + λ − 1)(α + βμ) is an upper bound,
    # streaming transport (link busy βμ, not α + βμ) beats it
    lam = 8
    bound = (2 * 5 + lam - 1) * (0.005 + 4e6 / lam / Bps(100))
    t = predict(make_plan("mst", g, length, {"chunks": lam, "root": "n0"}), g)["cct_s"]
    assert t <= bound * (1 + 1e-9)


def test_stop_and_wait_is_slower():
    g = build([("a", "b")], rate=100, delay=10)
    one = manual(["a", "b"], [("a", "b", 0)], 10_000)
    r = predict(one, g, stop_and_wait=True)
    xfer = 40_000 / Bps(100)
    assert r["result_s"] == pytest.approx(0.01 + xfer)  # data arrives as usual
    assert r["cct_s"] == pytest.approx(0.02 + xfer)  # the send completes on the ACK
    g9 = ring_graph(9, delay=20)
    plan = make_plan("ring", g9, 90_000, {"chunks": 4})
    assert predict(plan, g9, stop_and_wait=True)["cct_s"] > 1.2 * predict(plan, g9)["cct_s"]


def test_pipelined_ps_beats_plain_ps():
    g = build([("hub", f"w{i}") for i in range(5)], rate=100, delay=10)
    plain = predict(make_plan("ps", g, 1_000_000, {"hub": "hub"}), g)["cct_s"]
    piped = predict(make_plan("ps", g, 1_000_000, {"hub": "hub", "shards": 8}), g)["cct_s"]
    assert plain == pytest.approx(2 * (0.01 + 4e6 / Bps(100)))
    assert piped < 0.7 * plain


def test_contention_makes_predict_slower_than_alpha_beta():
    g = build([("c", f"l{i}") for i in range(5)], rate=100, delay=10)  # star; alltoall routes via c
    plan = make_plan("alltoall", g, 500_000)
    assert predict(plan, g)["cct_s"] > 1.5 * alpha_beta(plan, g)["cct_s"]


def test_deadlock_is_reported():
    b = ProgramBuilder(["a", "b"])
    # each node waits for the other's data before sending its own
    b.programs["a"].append(Op(0, "recv", "b", 1, 0, 1))
    b.programs["a"].append(Op(1, "send", "b", 0, 0, 1, deps=(0,)))
    b.programs["b"].append(Op(0, "recv", "a", 0, 0, 1))
    b.programs["b"].append(Op(1, "send", "a", 1, 0, 1, deps=(0,)))
    plan = Plan("dead", ["a", "b"], 1, b.programs)
    g = build([("a", "b")])
    with pytest.raises(PlanError, match="deadlock"):
        predict(plan, g)
    with pytest.raises(PlanError, match="deadlock"):
        alpha_beta(plan, g)


def test_ten_thousand_transfers_under_two_seconds():
    g = ring_graph(9, rate=100, delay=10)
    plan = make_plan("ring", g, 9 * 70 * 100, {"chunks": 70})
    n = sum(1 for _ in plan.transfers())
    assert n >= 10_000
    t0 = time.perf_counter()
    r = predict(plan, g)
    assert time.perf_counter() - t0 < 2.0
    assert r["transfers"] == n and r["cct_s"] > 0


def test_netstorm_schemes_run_and_report():
    import random
    rnd = random.Random(1)
    edges = [("h1", "h2"), ("h1", "h3"), ("h2", "h3"), ("h2", "h5"), ("h3", "h4"), ("h4", "h5"), ("h4", "h6"),
             ("h5", "h7"), ("h6", "h7"), ("h6", "h8"), ("h6", "h9"), ("h7", "h8"), ("h8", "h9")]
    g = nx.DiGraph()
    for u, v in edges:
        for a, b in ((u, v), (v, u)):
            g.add_edge(a, b, rate_mbps=rnd.randint(20, 155), delay_ms=30.0)
    for scheme in ("ps", "ring", "alltoall", "bkt", "mst"):
        plan = make_plan(scheme, g, 250_000)
        r = predict(plan, g)
        ab = alpha_beta(plan, g)
        assert r["cct_s"] >= ab["cct_s"] * (1 - 1e-9)
        assert set(r["node_finish_s"]) == set(g.nodes)
        assert r["bottleneck"] in r["per_link_bytes"]
        paths = shortest_paths(g)
        total = sum(op.length * 4 * (len(paths[(n, op.peer)]) - 1) for n, op in plan.transfers())
        assert sum(r["per_link_bytes"].values()) == pytest.approx(total)



# --- cross-check against a deliberately naive simulator ----------------------------
def naive_predict(plan, graph, elem_bytes=4):  # noqa: C901, PLR0915 -- an independent reference simulation, kept in one piece
    """Same semantics as predict, written the obvious way: recompute every flow's max-min
    rate from scratch at every event and advance every flow (reference for tests only)."""
    import heapq
    from collections import deque

    from testbed.costmodel import _Ops, _Routes

    ops, routes = _Ops(plan), _Routes(graph)
    n = len(ops.ops)
    links, alpha, size, conn, cid = [()] * n, [0.0] * n, [0.0] * n, [0] * n, {}
    for i, op in enumerate(ops.ops):
        if ops.is_send[i]:
            links[i], alpha[i], _ = routes.get(ops.node[i], op.peer)
            size[i] = op.length * elem_bytes
            conn[i] = cid.setdefault((ops.node[i], op.peer, op.channel), len(cid))
    queues, busy = [deque() for _ in cid], [False] * len(cid)
    done, arrived, ready, unmet = [-1.0] * n, [False] * n, [False] * n, list(ops.unmet)
    events, active, t, seq = [], {}, 0.0, 0
    work = deque(i for i in range(n) if unmet[i] == 0)

    def complete(i):
        done[i] = t
        for u in ops.users[i]:
            unmet[u] -= 1
            if unmet[u] == 0:
                work.append(u)

    def pump(c):
        if not busy[c] and queues[c]:
            busy[c] = True
            active[queues[c].popleft()] = None

    while True:
        while work:
            i = work.popleft()
            if ops.is_send[i]:
                queues[conn[i]].append(i)
                pump(conn[i])
            else:
                ready[i] = True
                if arrived[i]:
                    complete(i)
        for i in active:
            if active[i] is None:
                active[i] = size[i]
        # progressive filling over individual flows
        rem = {l: routes.cap[l] for i in active for l in links[i]}
        rate, left = {}, set(active)
        while left:
            share = {l: rem[l] / sum(1 for i in left if l in links[i]) for l in rem
                     if any(l in links[i] for i in left)}
            lmin = min(share, key=share.get)
            for i in [i for i in left if lmin in links[i]]:
                rate[i] = share[lmin]
                left.discard(i)
                for l in links[i]:
                    rem[l] -= share[lmin]
        dt = min((active[i] / rate[i] for i in active), default=float("inf"))
        te = events[0][0] if events else float("inf")
        if dt == float("inf") and te == float("inf"):
            break
        step = min(dt, te - t)
        finished = []
        for i in active:
            active[i] -= rate[i] * step
            if active[i] <= 1e-9 * size[i]:
                finished.append(i)
        t += step
        for i in finished:
            del active[i]
            seq += 1
            heapq.heappush(events, (t + alpha[i], seq, ops.partner[i]))
            complete(i)
            busy[conn[i]] = False
            pump(conn[i])
        while events and events[0][0] <= t + 1e-12 * (1 + t):
            _, _, r = heapq.heappop(events)
            arrived[r] = True
            if ready[r]:
                complete(r)
    return max(done)


@pytest.mark.parametrize("seed", range(12))
def test_predict_matches_naive_simulator(seed):
    import random
    rnd = random.Random(seed)
    n = 3 + seed % 4
    base = nx.gnm_random_graph(n, n + 2, seed=seed)
    base.add_edges_from((i, i + 1) for i in range(n - 1))  # connected
    g = nx.DiGraph()
    for u, v in base.edges:
        for a, b in ((u, v), (v, u)):
            g.add_edge(f"d{a}", f"d{b}", rate_mbps=rnd.randint(20, 155), delay_ms=rnd.uniform(1, 50))
    for scheme, params in [("alltoall", {}), ("ps", {"shards": 2}), ("ring", {"chunks": 2}),
                           ("bkt", {"chunks": 2}), ("mst", {"chunks": 3})]:
        plan = make_plan(scheme, g, 5000, params)
        assert predict(plan, g)["cct_s"] == pytest.approx(naive_predict(plan, g), rel=1e-9), scheme


def test_trace_gives_each_transfer_its_wire_and_done_times():
    # a->b then b->c (store and forward), 100 Mbit/s, 10 ms: the second starts when the first is received
    g = build([("a", "b"), ("b", "c")], rate=100, delay=10)
    b = ProgramBuilder(["a", "b", "c"])
    _, r = b.transfer("a", "b", 0, 1000, reduce=False)
    b.transfer("b", "c", 0, 1000, reduce=False, send_deps=[r])
    plan = Plan("chain", ["a", "b", "c"], 1000, b.programs)
    out = predict(plan, g, trace=True)
    t1 = 4000 / Bps(100)
    (x0, s0, d0, st0, en0, dn0), (x1, s1, d1, st1, en1, dn1) = out["trace"]
    assert (s0, d0, s1, d1) == ("a", "b", "b", "c")
    assert (st0, en0, dn0) == pytest.approx((0.0, t1, t1 + 0.010))
    assert (st1, en1, dn1) == pytest.approx((t1 + 0.010, 2 * t1 + 0.010, 2 * t1 + 0.020))
    assert out["cct_s"] == pytest.approx(dn1)
    assert "trace" not in predict(plan, g)


def _forwarding_chain(chunks: int, elems: int, second_child: bool = False) -> Plan:
    """a -> b -> c, b adding each chunk (and d's, with ``second_child``) before forwarding it."""
    nodes = ["a", "b", "c", "d"]
    b = ProgramBuilder(nodes)
    for k in range(chunks):
        _, r = b.transfer("a", "b", k * elems, elems, reduce=True, chunk=k)
        deps = [r]
        if second_child:
            deps.append(b.transfer("d", "b", k * elems, elems, reduce=True, chunk=k)[1])
        b.transfer("b", "c", k * elems, elems, reduce=True, send_deps=deps, chunk=k)
    return Plan("chain", nodes, chunks * elems, b.programs)


@pytest.mark.parametrize("r1, r2", [(100, 50), (50, 100)])
@pytest.mark.parametrize("second_child", [False, True])
def test_cut_through_forwards_at_the_slower_hops_pace(r1, r2, second_child):
    """Cut-through (the executor's): a chunk forwarded as it arrives takes α1 + α2 + S / min(r1, r2)
    plus at most one sub-block at the faster hop's rate (the first sub-block before forwarding
    starts, or the last one after the slower upstream ends), whatever the chunk count;
    store-and-forward pays the first hop per chunk."""
    g = build([("a", "b"), ("b", "c"), ("d", "b")], rate=r1, delay=10)
    g["b"]["c"]["rate_mbps"] = g["c"]["b"]["rate_mbps"] = r2
    g["b"]["c"]["delay_ms"] = 20
    sub, total = 1 << 16, 4_000_000
    for chunks in (1, 4):
        plan = _forwarding_chain(chunks, total // chunks, second_child)
        ct = predict(plan, g, cut_through_bytes=sub)["cct_s"]
        least = 0.030 + total * 4 / Bps(min(r1, r2))
        assert least <= ct <= least + sub / Bps(max(r1, r2)) + 1e-9
        sf = predict(plan, g)["cct_s"]
        assert sf == pytest.approx(0.030 + total * 4 / chunks / Bps(max(r1, r2)) + total * 4 / Bps(min(r1, r2)),
                                   rel=1e-6)


def test_cut_through_model_uses_the_experiments_sub_block():
    """The prediction models the sub-block the agents are given: the default is the
    executor's own, and another ``agents.subblock_bytes`` changes the prediction."""
    from agents.executor import SUBBLOCK_BYTES
    from testbed import config
    from testbed.experiment import build_plan

    def built(**agents):
        return config.validate({"name": "t", "topology": "quick-5", "scheme": {"name": "mtree"},
                                "workload": {"size": "4MB"}, "agents": agents}, "<t>")

    default = built()
    assert default.agents.subblock_bytes == SUBBLOCK_BYTES
    small = built(subblock_bytes="8KiB")
    assert small.agents.subblock_bytes == 8192
    assert build_plan(small).prediction["cct_s"] < build_plan(default).prediction["cct_s"]


def test_shared_links_share_by_the_rates_as_weights_and_conserve_work():
    """``links="shared"``: two channels a->b paced at 30 and 10 Mbit/s on a 100 Mbit/s link
    take 75 and 25 Mbit/s while both send, and the one left takes the whole link (work
    conserving); as caps (a connection per channel) they keep 30 and 10.  A channel without a
    rate makes the shares equal."""
    g = build([("a", "b")], rate=100, delay=0)
    size = 1_000_000  # 4 MB each

    def plan(r0, r1):
        b = ProgramBuilder(["a", "b"])
        b.transfer("a", "b", 0, size, reduce=False, channel=0, rate_mbps=r0)
        b.transfer("a", "b", size, size, reduce=False, channel=1, rate_mbps=r1)
        return Plan("two", ["a", "b"], 2 * size, b.programs)
    mbit = size * 4 * 8 / 1e6  # 32 Mbit each
    shared = predict(plan(30, 10), g, links="shared", trace=True)
    left = sorted(row[4] for row in shared["trace"])
    assert left[0] == pytest.approx(mbit / 75)  # the heavier at 75 Mbit/s while both send
    assert left[1] == pytest.approx(2 * mbit / 100)  # the link never idles: the lighter takes it all after
    assert predict(plan(30, 10), g)["cct_s"] == pytest.approx(mbit / 10)  # as caps: the slower one's 3.2 s
    equal = sorted(row[4] for row in predict(plan(30, 0), g, links="shared", trace=True)["trace"])
    assert equal == pytest.approx([2 * mbit / 100] * 2)  # one channel without a rate: equal shares
