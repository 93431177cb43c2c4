"""Splitting a served name's requests among its versions (pure)."""

from collections import Counter

from pipecast.router.versions import VersionChooser, route_versions

A, B, C = "a" * 64, "b" * 64, "c" * 64


def picks(chooser: VersionChooser, versions, serving, n: int, name: str = "chat") -> list[str]:
    return [chooser.choose(versions, name, serving) for _ in range(n)]


def test_the_weights_hold_exactly_over_every_window_of_their_period():
    chooser = VersionChooser()
    chosen = picks(chooser, ((A, 90), (B, 10)), {A, B}, 100)
    assert Counter(chosen) == {A: 90, B: 10}
    assert all(chosen[k:k + 10].count(B) == 1 for k in range(0, 100, 10))  # one in ten, every ten
    three = picks(VersionChooser(), ((A, 50), (B, 25), (C, 25)), {A, B, C}, 8)
    assert Counter(three) == {A: 4, B: 2, C: 2} and three[:2] == [A, B]  # interleaved, not in runs


def test_a_version_without_workers_gives_its_share_to_the_others_and_none_falls_back_to_stable():
    chooser = VersionChooser()
    assert set(picks(chooser, ((A, 90), (B, 10)), {A}, 20)) == {A}
    assert set(picks(chooser, ((A, 90), (B, 10)), {B}, 5)) == {B}
    assert picks(chooser, ((A, 90), (B, 10)), set(), 3) == [A, A, A]
    assert picks(chooser, ((A, 100), (B, 0)), {A, B}, 3) == [A, A, A]


def test_state_of_rolled_back_versions_and_removed_names_is_dropped():
    chooser = VersionChooser()
    picks(chooser, ((A, 50), (B, 50)), {A, B}, 3)
    picks(chooser, ((A, 100),), {A, B}, 1)
    assert list(chooser._credit["chat"]) == [A]
    chooser.forget({})
    assert chooser._credit == {}


def test_only_a_routed_string_model_has_versions():
    routes = {"chat": ((A, 100),)}
    assert route_versions(routes, "chat") == ((A, 100),)
    assert route_versions(routes, "other") is None and route_versions(routes, ["chat"]) is None
