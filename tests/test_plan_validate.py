"""Illegal plans are rejected, each with the reason (in the spirit of msccl-tools' tests of
illegal programs): every check of ``Plan.validate``, and the interpreter's deadlock and
wrong-result checks that ``validate`` cannot see."""

import re

import numpy as np
import pytest

from testbed.plan import RECV, SEND, Op, Plan, PlanError, check_allreduce, interpret

N = 8  # elements


def send(i, peer, xfer, off=0, n=N, **kw):
    return Op(i, SEND, peer, xfer, off, n, **kw)


def recv(i, peer, xfer, off=0, n=N, **kw):
    return Op(i, RECV, peer, xfer, off, n, **kw)


def plan(programs, **kw):
    nodes = kw.pop("nodes", ["a", "b"])
    return Plan("test", nodes, N, {n: programs.get(n, []) for n in nodes} | programs, **kw)


def two_way():
    """A correct AllReduce of two nodes: swap, then add what arrived."""
    return {"a": [send(0, "b", 0), recv(1, "b", 1, reduce=True, deps=(0,))],
            "b": [send(0, "a", 1), recv(1, "a", 0, reduce=True, deps=(0,))]}


def test_a_legal_plan_passes_and_reduces():
    p = plan(two_way())
    p.validate()
    rng = np.random.default_rng(0)
    check_allreduce(p, {n: rng.integers(-9, 9, N).astype(np.float64) for n in p.nodes})


ILLEGAL = {
    # name: (programs, extra Plan fields, error message)
    "participant not a node": (two_way(), {"participants": ["a", "zz"]}, "participants names unknown node 'zz'"),
    "receiver not a node": (two_way(), {"receivers": ["zz"]}, "receivers names unknown node 'zz'"),
    "program of an unknown node": ({**two_way(), "zz": []}, {}, "program for unknown node 'zz'"),
    "duplicate op ids": ({"a": [send(0, "b", 0), send(0, "b", 1, off=4, n=4)],
                          "b": [recv(0, "a", 0), recv(1, "a", 1, off=4, n=4, deps=(0,))]}, {}, "a: duplicate op ids"),
    "unknown op kind": ({"a": [Op(0, "copy", "b", 0, 0, N)], "b": [recv(0, "a", 0)]}, {}, "unknown kind 'copy'"),
    "peer is not a node": ({"a": [send(0, "zz", 0)]}, {}, "bad peer 'zz'"),
    "peer is the node itself": ({"a": [send(0, "a", 0)]}, {}, "bad peer 'a'"),
    "unknown buffer": ({"a": [send(0, "b", 0, buf="tmp")], "b": [recv(0, "a", 0)]}, {}, "unknown buffer 'tmp'"),
    "block past the end": ({"a": [send(0, "b", 0, off=4, n=5)], "b": [recv(0, "a", 0, off=4, n=5)]}, {},
                           "outside x"),
    "block past a scratch buffer": ({"a": [send(0, "b", 0, buf="t", n=4)], "b": [recv(0, "a", 0, n=4)]},
                                    {"scratch": {"a": {"t": 3}}}, "outside t"),
    "negative offset": ({"a": [send(0, "b", 0, off=-1, n=2)], "b": [recv(0, "a", 0, off=-1, n=2)]}, {}, "outside x"),
    "empty block": ({"a": [send(0, "b", 0, n=0)], "b": [recv(0, "a", 0, n=0)]}, {}, "outside x"),
    "dependency on a missing op": ({"a": [send(0, "b", 0, deps=(7,))], "b": [recv(0, "a", 0)]}, {},
                                   "unknown deps [7]"),
    "two sends of one transfer": ({"a": [send(0, "b", 0, n=4), send(1, "b", 0, off=4, n=4)],
                                   "b": [recv(0, "a", 0, n=4)]}, {}, "transfer 0 has two send ops"),
    "two recvs of one transfer": ({"a": [send(0, "b", 0, n=4)],
                                   "b": [recv(0, "a", 0, n=4), recv(1, "a", 0, off=4, n=4)]}, {},
                                  "transfer 0 has two recv ops"),
    "dependency cycle": ({"a": [send(0, "b", 0, n=4, deps=(1,)), send(1, "b", 1, off=4, n=4, deps=(0,))],
                          "b": [recv(0, "a", 0, n=4), recv(1, "a", 1, off=4, n=4)]}, {}, "a: dependency cycle"),
    "self dependency": ({"a": [send(0, "b", 0, deps=(0,))], "b": [recv(0, "a", 0)]}, {}, "dependency cycle"),
    "send without recv": ({"a": [send(0, "b", 0)]}, {}, "unmatched transfers"),
    "recv without send": ({"b": [recv(0, "a", 0)]}, {}, "unmatched transfers"),
    "send and recv name other peers": ({"a": [send(0, "b", 0)], "b": [], "c": [recv(0, "a", 0)]},
                                       {"nodes": ["a", "b", "c"]}, "transfer 0: send a->b does not match"),
    "send and recv differ in length": ({"a": [send(0, "b", 0, n=4)], "b": [recv(0, "a", 0, n=5)]}, {},
                                       "does not match"),
    "send and recv on different channels": ({"a": [send(0, "b", 0, channel=1)], "b": [recv(0, "a", 0)]}, {},
                                            "does not match"),
    # races: a write overlapping any other access of the same data must be ordered by deps
    "overwrite races the send reading it": ({"a": [send(0, "b", 0), recv(1, "b", 1)],
                                             "b": [recv(0, "a", 0, reduce=True), send(1, "a", 1, deps=(0,))]}, {},
                                            "a: ops 0 and 1 touch the same data of 'x' unordered"),
    "reduce races the send reading it": ({"a": [send(0, "b", 0, n=4), recv(1, "b", 1, off=2, n=4, reduce=True)],
                                          "b": [recv(0, "a", 0, n=4), send(1, "a", 1, off=2, n=4)]}, {},
                                         "a: ops 0 and 1 touch the same data"),
    "two overwrites race": ({"a": [send(0, "c", 0), send(1, "c", 1)], "b": [],
                             "c": [recv(0, "a", 0), recv(1, "a", 1)]},
                            {"nodes": ["a", "b", "c"]}, "c: ops 0 and 1 touch the same data"),
    "overwrite races a reduce": ({"a": [send(0, "c", 0), send(1, "c", 1, off=4, n=4)], "b": [],
                                  "c": [recv(0, "a", 0, reduce=True), recv(1, "a", 1, off=4, n=4)]},
                                 {"nodes": ["a", "b", "c"]}, "c: ops 0 and 1 touch the same data"),
    "race through a scratch buffer": ({"a": [send(0, "b", 0, n=4, buf="t"), recv(1, "b", 1, n=4, buf="t")],
                                       "b": [recv(0, "a", 0, n=4), send(1, "a", 1, n=4, off=4)]},
                                      {"scratch": {"a": {"t": 4}}}, "touch the same data of 't' unordered"),
}


@pytest.mark.parametrize("case", sorted(ILLEGAL))
def test_illegal_plan_is_rejected(case):
    programs, fields, message = ILLEGAL[case]
    p = plan(programs, **fields)
    with pytest.raises(PlanError, match=re.escape(message)):
        p.validate()


LEGAL = {
    "reduces into one range need no order (addition commutes)": (
        {"a": [send(0, "c", 0)], "b": [send(0, "c", 1)],
         "c": [recv(0, "a", 0, reduce=True), recv(1, "b", 1, reduce=True)]}, {"nodes": ["a", "b", "c"]}),
    "disjoint ranges need no order": (
        {"a": [send(0, "b", 0, n=4), recv(1, "b", 1, off=4, n=4)],
         "b": [recv(0, "a", 0, n=4), send(1, "a", 1, off=4, n=4)]}, {}),
    "an overwrite ordered after the send (transitively)": (
        {"a": [send(0, "b", 0), send(1, "b", 2, n=1, buf="t", deps=(0,)), recv(2, "b", 1, deps=(1,))],
         "b": [recv(0, "a", 0, reduce=True), recv(1, "a", 2, n=1, buf="t"), send(2, "a", 1, deps=(0,))]},
        {"scratch": {"a": {"t": 1}, "b": {"t": 1}}}),
    "two sends read one range concurrently": (
        {"a": [send(0, "b", 0), send(1, "c", 1)], "b": [recv(0, "a", 0)], "c": [recv(0, "a", 1)]},
        {"nodes": ["a", "b", "c"]}),
}


@pytest.mark.parametrize("case", sorted(LEGAL))
def test_legal_corner_cases_pass(case):
    programs, fields = LEGAL[case]
    plan(programs, **fields).validate()


def test_cross_node_deadlock_passes_validate_but_the_interpreter_finds_it():
    """validate checks each program alone; a wait cycle across nodes shows when run."""
    p = plan({"a": [recv(0, "b", 0), send(1, "b", 1, deps=(0,))],
              "b": [recv(0, "a", 1), send(1, "a", 0, deps=(0,))]})
    p.validate()
    with pytest.raises(PlanError, match="plan deadlocks"):
        interpret(p, {n: np.ones(N) for n in p.nodes})


def test_a_legal_plan_that_computes_the_wrong_thing_is_caught():
    """b overwrites instead of adding: race-free, deadlock-free, wrong."""
    p = plan({"a": [send(0, "b", 0), recv(1, "b", 1, reduce=True, deps=(0,))],
              "b": [send(0, "a", 1), recv(1, "a", 0, deps=(0,))]})
    p.validate()
    with pytest.raises(PlanError, match="b ends with a wrong value at element 0"):
        check_allreduce(p, {"a": np.arange(N, dtype=float), "b": np.ones(N)})
