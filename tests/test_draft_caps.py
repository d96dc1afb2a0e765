"""A request's draft cap (``TokenizedRequest.max_drafts``): each of its steps commits at most
that many drafts and then the target's own token, beside requests with other caps or none in
the same batches; its tokens stay the target-only ones, greedy and seeded, under every draft
algorithm through the overlap loop and the serial one; a batch whose requests all turned
speculation off takes plain steps."""

from __future__ import annotations

import pytest
from engine_harness import DRAFT_ALGORITHMS, debug_checks_fixture, engine_for, request, run
from model_fixtures import mixed_prompts, save_drafts, save_tiny_model

from outrider.protocol.frames import FAMILY_CLIENT_REQUEST, FrameCodec, FrameError, request_codec
from outrider.protocol.messages import ClientRequest, Generate, request_revision

debug_checks = debug_checks_fixture()

PROMPTS = mixed_prompts(11, 4)
CAPS = [None, 0, 1, 2]  # per request, each prompt under each
NEW_TOKENS = 16
STEPS = 3  # the target's own draft drafts this many a step


def _requests(temperature: float = 0.0, caps: list[int | None] = CAPS) -> list:
    return [
        request(len(caps) * p + c, prompt, max_new_tokens=NEW_TOKENS, temperature=temperature,
                seed=p, max_drafts=cap)
        for p, prompt in enumerate(PROMPTS)
        for c, cap in enumerate(caps)
    ]  # fmt: skip


def _cap(rid: int) -> int | None:
    """The cap of ``_requests``' request ``rid``."""
    return CAPS[rid % len(CAPS)]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, str]]:
    root = tmp_path_factory.mktemp("draft-caps")
    save_tiny_model("llama", root / "target")
    return str(root / "target"), save_drafts(root / "drafts", root / "target")


def _settings(algorithm: str, drafts: dict[str, str]) -> dict[str, object]:
    """``DRAFT_ALGORITHMS[algorithm]``'s flags, with its saved draft where it needs one."""
    settings = dict(DRAFT_ALGORITHMS[algorithm])
    name = str(settings["speculative_algorithm"])
    if name in drafts:
        settings["draft_model"] = drafts[name]
    return settings


def _itself(directory: str) -> dict[str, object]:
    """The target as its own standalone draft: every draft is the target's greedy choice."""
    return {
        "speculative_algorithm": "standalone",
        "draft_model": directory,
        "speculative_num_steps": STEPS,
    }


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_each_step_commits_at_most_the_cap_and_the_tokens_stay_the_targets(
    target: tuple[str, dict[str, str]], temperature: float
) -> None:
    directory, _ = target
    plain = run(engine_for(directory), _requests(temperature))
    outcomes = run(engine_for(directory, **_itself(directory)), _requests(temperature))
    for rid, outcome in plain.items():
        assert outcomes[rid].token_ids == outcome.token_ids, rid
    for rid, outcome in outcomes.items():
        cap, usage = _cap(rid), outcome.finish.usage
        if cap == 0:  # plain steps, or verifies that commit the target's token alone
            assert usage.spec_accepted_tokens == 0, rid
            continue
        most = STEPS if cap is None else cap
        assert 0 < usage.spec_accepted_tokens <= most * usage.spec_drafts, (rid, usage)
        if temperature == 0.0:  # greedy drafts of the target itself: every one accepted, but
            # in the last step, which the length may cut
            assert usage.spec_accepted_tokens >= most * (usage.spec_drafts - 1), (rid, usage)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("algorithm", list(DRAFT_ALGORITHMS))
def test_every_algorithm_keeps_the_target_only_tokens_under_caps(
    target: tuple[str, dict[str, str]], algorithm: str, overlap: bool
) -> None:
    directory, drafts = target
    settings = _settings(algorithm, drafts)
    for temperature in (0.0, 1.0):
        plain = run(engine_for(directory), _requests(temperature))
        engine = engine_for(directory, no_overlap=not overlap, **settings)
        outcomes = run(engine, _requests(temperature))
        for rid, outcome in plain.items():
            assert outcomes[rid].token_ids == outcome.token_ids, (temperature, rid)
        off = [o.finish.usage.spec_accepted_tokens for r, o in outcomes.items() if _cap(r) == 0]
        assert off == [0] * len(PROMPTS), off


# The algorithms whose chain a batch's caps cut (``SchedulerLimits.shorter_chains``; DFlash a
# shorter block); caps never cut a tree.
CUT_SHORT = {"ngram", "eagle3 chain", "standalone", "dflash"}


@pytest.mark.parametrize("algorithm", list(DRAFT_ALGORITHMS))
def test_a_batch_capped_below_the_depth_verifies_a_chain_cut_to_its_largest_cap(
    target: tuple[str, dict[str, str]], algorithm: str
) -> None:
    """Requests capped at 0 and 1 drafts: a chain's drafting steps draft and verify one
    draft a row (the counters count one drafted token per verify row), a tree its whole
    shape; the tokens stay the target-only ones, greedy and seeded."""
    directory, drafts = target
    settings = _settings(algorithm, drafts)
    for temperature in (0.0, 1.0):
        requests = _requests(temperature, caps=[0, 1])
        plain = run(engine_for(directory), requests)
        engine = engine_for(directory, **settings)
        outcomes = run(engine, _requests(temperature, caps=[0, 1]))
        for rid, outcome in plain.items():
            assert outcomes[rid].token_ids == outcome.token_ids, (temperature, rid)
        counters = engine.scheduler.counters()
        drafted = 1 if algorithm in CUT_SHORT else engine.loop.runner.shape.width - 1
        assert engine.loop.runner.shape.width - 1 > 1  # the cut is a cut
        assert counters.spec_drafts > 0
        assert counters.spec_draft_tokens == drafted * counters.spec_drafts, temperature
        assert len(counters.spec_accepted_per_position) == engine.loop.runner.shape.max_commit - 1
        assert sum(counters.spec_accepted_per_position[1:]) == 0  # no cap passes 1


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", list(DRAFT_ALGORITHMS))
def test_capped_rows_in_replayed_graphs_keep_the_eager_tokens(
    target: tuple[str, dict[str, str]], algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA the caps ride in captured batches (each slot's bound read by the replayed
    verify), every launch under the sync check: greedy and seeded tokens are the eager
    engine's, and a request that turned speculation off accepts no draft."""
    monkeypatch.setenv("OUTRIDER_DEBUG_SYNC_CHECK", "1")
    monkeypatch.delenv("OUTRIDER_DEBUG_RELAY_CHECK")  # graphs are off under it (build.py)
    directory, drafts = target
    settings = {"device": "cuda", **_settings(algorithm, drafts)}
    for temperature in (0.0, 1.0):
        eager = engine_for(directory, disable_cuda_graph=True, **settings)
        expected = run(eager, _requests(temperature))
        graphed = engine_for(directory, **settings)
        assert graphed.loop.runner.graphs is not None
        outcomes = run(graphed, _requests(temperature))
        for rid, outcome in expected.items():
            assert outcomes[rid].token_ids == outcome.token_ids, (temperature, rid)
        off = [o.finish.usage.spec_accepted_tokens for r, o in outcomes.items() if _cap(r) == 0]
        assert off == [0] * len(PROMPTS), off


def test_a_batch_that_turned_speculation_off_takes_plain_steps(
    target: tuple[str, dict[str, str]],
) -> None:
    directory, _ = target
    engine = engine_for(directory, **_itself(directory))
    outcomes = run(engine, _requests(caps=[0]))
    assert engine.scheduler.counters().spec_drafts == 0
    plain = run(engine_for(directory), _requests(caps=[0]))
    assert {r: o.token_ids for r, o in outcomes.items()} == {
        r: o.token_ids for r, o in plain.items()
    }


def test_a_capped_request_travels_as_protocol_1_3_which_a_1_2_daemon_refuses() -> None:
    capped = Generate("c", prompt="x", max_drafts=0)
    assert request_revision(capped) == 4
    assert request_revision(Generate("p", prompt="x")) == 1
    frame = request_codec().encode(capped, request_revision(capped))
    assert request_codec().decode(frame) == capped
    older = FrameCodec(FAMILY_CLIENT_REQUEST, ClientRequest, 3, 1)
    with pytest.raises(FrameError) as refused:
        older.decode(frame)
    assert (refused.value.code, refused.value.request_id) == ("unsupported_version", "c")
