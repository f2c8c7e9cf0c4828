"""What poise decided, said plainly (poise/decide/): decisions from a report's own keys, pins,
and the re-planning cadence of balance auto."""

import pytest

from poise.config import BalanceConfig
from poise.decide import decisions, default_codec, describe, replan_schedule


def _replan(step: int, decision: str, shares=(0.5, 0.5)) -> dict:
    return {"step": step, "speeds": [4000.0, 2000.0], "shares": list(shares), "alpha": 1e-3,
            "rel_error": [0.02, 0.02], "decision": decision, "window_steps": 3}


def test_auto_names_the_split_and_each_share_move_with_its_figures_and_pin():
    report = {"balance_strategy": "auto", "codec": "none", "codec_by_poise": "one node: ...",
              "sync": {"mode": "step"}, "straggler": [None, None],
              "replans": [_replan(2, "wait"), _replan(3, "jump", (0.667, 0.333)), _replan(4, "hold"),
                          _replan(9, "edge", (0.66, 0.34))]}
    found = decisions(report)
    knobs = [(d.knob, d.step) for d in found]
    assert knobs == [("balance", 0), ("comm.codec", 0), ("sync", 0), ("straggler", 0), ("balance.shares", 3),
                     ("balance.shares", 9)]  # wait and hold move nothing: not decisions
    split, move = found[0], found[4]
    assert split.by == "poise" and "DDP's steps" in split.choice and split.pin.startswith("balance='auto'")
    assert found[3].choice == "off" and found[3].pin == "straggler='off'"  # a pin keeps the choice
    assert move.choice == "shares 0.667 0.333" and "4,000 2,000 cost units/s" in move.why and "jump" in move.why
    assert move.figures["shares"] == [0.667, 0.333] and "balance.replay" in move.pin
    assert all(d.by == "poise" for d in found)  # nothing was set: every choice is poise's


def test_settings_the_user_gave_are_said_as_theirs():
    report = {"balance_strategy": "static", "codec": "fp16", "sync": {"mode": "diloco"}, "straggler": [{"x": 1}]}
    by = {d.knob: d.by for d in decisions(report)}
    assert by == {"balance": "you", "comm.codec": "you", "sync": "you", "straggler": "you"}


def test_automatic_codec_and_synchronization_say_what_they_measured():
    trial = {"start_step": 12, "trial_steps": 3, "margin": 1.25, "uncompressed_step_s": 0.8, "codec_step_s": 0.3,
             "uses_codec": True}
    sync = {"mode": "auto: diloco", "auto": {"mode": "diloco", "inner_steps": 10, "ddp_compute_s": 0.5,
                                             "ddp_exposed_s": 0.4, "why": "DDP's all-reduce left 0.4 s exposed"}}
    found = {d.knob: d for d in decisions({"codec": "auto", "codec_trial": trial, "sync": sync})}
    codec, outer = found["comm.codec"], found["sync"]
    assert (codec.choice, codec.step, codec.pin) == ("powersgd", 12, "comm='powersgd'")
    assert "0.800 s uncompressed" in codec.why and "0.300 s" in codec.why
    assert outer.choice == "diloco, an outer step every 10 steps" and outer.why.startswith("DDP's all-reduce")
    assert outer.pin == "sync=SyncConfig(mode='diloco', inner_steps=10)" and outer.figures["ddp_exposed_s"] == 0.4
    unfinished = decisions({"codec": "auto", "codec_trial": {**trial, "uses_codec": None},
                            "sync": {"mode": "auto"}})
    assert [d.choice for d in unfinished] == ["exact (PowerSGD trial not finished)", "step (auto's trial not finished)"]


def test_a_report_without_the_keys_gives_no_decision_and_junk_is_skipped():
    assert decisions({}) == []
    assert [d.knob for d in decisions({"balance_strategy": "auto", "replans": ["junk", 3, None]})] == ["balance"]


def test_the_console_lists_the_first_and_last_share_moves_and_counts_the_rest():
    report = {"balance_strategy": "auto", "replans": [_replan(s, "edge", (0.6, 0.4)) for s in range(2, 22)]}
    lines = describe(decisions(report), most=4)
    assert len(lines) == 1 + 2 + 1 + 2  # the split, two first moves, the count, two last moves
    assert "16 more share moves" in lines[3] and lines[-1].startswith("step   21")


def test_auto_replans_after_every_step_and_a_pinned_dynamic_keeps_its_cadence():
    assert replan_schedule(BalanceConfig()) == {"cold_start_steps": 10, "replan_every_steps": 1, "confirm_steps": 3,
                                                "max_replan_every_steps": 4}
    pinned = BalanceConfig(strategy="dynamic", replan_every_steps=7, cold_start_steps=4)
    assert replan_schedule(pinned) == {"cold_start_steps": 4, "replan_every_steps": 7, "confirm_steps": 0,
                                       "max_replan_every_steps": None}


def test_an_undone_move_is_said_with_the_balance_that_undid_it():
    revert = {**_replan(12, "revert", (0.5, 0.5)), "measured_balance": [0.93, 0.81]}
    found = decisions({"balance_strategy": "auto", "replans": [_replan(8, "jump", (0.6, 0.4)), revert]})
    undone = found[-1]
    assert undone.step == 12 and undone.choice == "shares 0.500 0.500 (the last move undone)"
    assert "balance 0.810 against 0.930" in undone.why


def test_a_sampler_of_the_users_that_auto_cannot_replan_is_said_as_theirs():
    """Data(sampler=StaticSchedule(...)) with no balance setting: the sampler's split trains,
    nothing is re-planned, and the decision says so instead of claiming auto's split."""
    report = {"balance_strategy": "auto", "codec": "none", "sync": {"mode": "step"},
              "balance_sampler": {"type": "StaticSchedule", "replanned": False}}
    split = decisions(report)[0]
    assert split.knob == "balance" and split.by == "you" and split.choice.startswith("your StaticSchedule")
    assert "does not re-plan" in split.why and split.pin == "balance='static' (to say the sampler's split is meant)"
    replanned = decisions({**report, "balance_sampler": {"type": "BalancedBatchSampler", "replanned": True}})[0]
    assert replanned.by == "poise" and "DDP's steps" in replanned.choice


def test_a_codec_poise_chose_is_said_as_its_own_and_a_named_one_as_yours():
    exact = decisions({"codec": "none", "codec_by_poise": "one node: the gradient all-reduce crosses no link"})
    assert [(d.choice, d.by) for d in exact] == [("none (exact)", "poise")]
    assert exact[0].why.startswith("one node") and "comm='auto'" in exact[0].pin
    named = decisions({"codec": "none"})  # comm='none' given: exact, pinned by the user
    assert [(d.choice, d.by, d.pin) for d in named] == [("none", "you", "comm='none'")]


def test_a_kept_codec_that_its_measured_steps_do_not_confirm_is_dropped_and_said_so():
    trial = {"start_step": 7, "trial_steps": 3, "margin": 1.25, "uncompressed_step_s": 0.8, "codec_step_s": 0.3,
             "uses_codec": True, "confirm_steps": 3, "measured_codec_step_s": 0.7, "confirmed": False,
             "dropped_step": 11}
    found = decisions({"codec": "auto", "codec_trial": trial, "codec_by_poise": "several nodes: ..."})
    assert [(d.choice, d.step) for d in found] == [("powersgd", 7), ("none (exact again)", 11)]
    assert found[0].why.startswith("several nodes") and all(d.by == "poise" for d in found)
    assert "0.700 s against 0.800 s" in found[1].why and found[1].figures["measured_codec_step_s"] == 0.7
    kept = decisions({"codec": "auto", "codec_trial": {**trial, "confirmed": True, "dropped_step": None}})
    assert [d.choice for d in kept] == ["powersgd"]


ACROSS = {"spans_nodes": True, "sharded": False, "sync_mode": "step", "deadline": False, "accum_steps": 1,
          "run_length_known": True}


@pytest.mark.parametrize(("change", "codec", "words"), [
    ({}, "auto", "several nodes"),
    ({"spans_nodes": False}, "none", "one node"),
    ({"sharded": True}, "none", "sharded"),
    ({"sync_mode": "diloco"}, "none", "sync='diloco'"),
    ({"deadline": True}, "none", "whole steps"),
    ({"accum_steps": 4}, "none", "whole steps"),
    ({"run_length_known": False}, "none", "Data(total_steps=...)"),
])
def test_with_no_codec_named_only_a_job_across_nodes_whose_steps_the_trial_can_time_tries_powersgd(
        change, codec, words):
    chosen, why = default_codec(**{**ACROSS, **change})
    assert chosen == codec and words in why
