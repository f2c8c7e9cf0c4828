"""``comm.codec=auto``'s decision (``poise.comm.trial.CodecTrial``), without processes."""

from __future__ import annotations

import pytest

from poise.comm.trial import CodecTrial


def _run(trial: CodecTrial, step_s: float, comm_wait_s: float, dry_run_s: float) -> None:
    """Steps 0 to start - 1 uncompressed, each dry-run when due."""
    for step in range(trial.start):
        assert not trial.uses_codec(step)  # nothing is compressed before the choice
        trial.observe(step, step_s, comm_wait_s)
        if trial.dry_run_due(step):
            trial.observe_dry_run(step, dry_run_s)


def test_the_codec_is_used_only_if_its_predicted_step_beats_the_margin():
    # over 1 Gbit/s: 1.2 s steps, 0.9 s of them waiting for the reduction; PowerSGD's dry run 0.2 s
    fast = CodecTrial(5, steps=3, margin=1.25)
    _run(fast, step_s=1.2, comm_wait_s=0.9, dry_run_s=0.2)
    assert fast.ready and fast.medians() == pytest.approx((1.2, 0.3, 0.2))
    assert not fast.uses_codec(5)  # still undecided: uncompressed
    assert fast.decide(*fast.medians()) and fast.uses_codec(5) and not fast.uses_codec(4)
    assert fast.summary()["codec_step_s"] == pytest.approx(0.5)
    # over 10 Gbit/s: 0.55 s steps, 0.2 s waiting: 0.35 + 0.2 predicted, not 25 % faster
    slow = CodecTrial(5, steps=3, margin=1.25)
    _run(slow, step_s=0.55, comm_wait_s=0.2, dry_run_s=0.2)
    assert not slow.decide(*slow.medians()) and not slow.uses_codec(100)
    assert slow.summary()["uses_codec"] is False


def test_dry_runs_follow_the_last_uncompressed_steps_and_the_first_is_not_timed():
    trial = CodecTrial(7, steps=3)
    assert [s for s in range(10) if trial.dry_run_due(s)] == [4, 5, 6]
    for step, seconds in enumerate([9.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0]):
        trial.observe(step, seconds, 0.5)
        if trial.dry_run_due(step):
            trial.observe_dry_run(step, 5.0 if step == 4 else 0.1)
    assert trial.uncompressed_s == [1.0] * 5 and trial.compute_s == [0.5] * 5 and trial.dry_run_s == [0.1, 0.1]
    assert trial.ready
    trial.decide(*trial.medians())
    assert not any(trial.dry_run_due(s) for s in range(10))  # decided: no more dry runs
    trial.observe(7, 3.0, 0.0)
    assert trial.uncompressed_s == [1.0] * 5  # nor observations


def test_the_choice_survives_a_checkpoint():
    trial = CodecTrial(5, steps=3)
    _run(trial, 1.0, 0.8, 0.1)
    trial.decide(*trial.medians())
    restored = CodecTrial(5, steps=3)
    restored.load_state_dict(trial.state_dict())
    assert restored.choice is True and restored.decided_from == pytest.approx((1.0, 0.3)) and not restored.ready
    assert restored.uses_codec(5)
    with pytest.raises(ValueError, match="choice='yes'"):
        restored.load_state_dict({**trial.state_dict(), "choice": "yes"})


def _kept(confirm_steps: int = 3) -> CodecTrial:
    """A trial that kept PowerSGD from step 5: 1.2 s steps uncompressed, 0.5 s predicted."""
    trial = CodecTrial(5, steps=3, margin=1.25, confirm_steps=confirm_steps)
    _run(trial, step_s=1.2, comm_wait_s=0.9, dry_run_s=0.2)
    assert trial.decide(*trial.medians())
    return trial


@pytest.mark.parametrize(("compressed_s", "kept"), [(0.6, True), (1.0, False)])
def test_the_compressed_steps_confirm_a_kept_codec_or_it_is_dropped(compressed_s, kept):
    trial = _kept()
    trial.observe(5, 9.0, 0.0)  # the first compressed step allocates the codec's buffers: not timed
    for step in (6, 7):
        trial.observe(step, compressed_s, 0.0)
        assert not trial.confirm_ready
    trial.observe(8, compressed_s, 0.0)
    assert trial.confirm_ready and trial.compressed_s == [compressed_s] * 3
    assert trial.confirm(1.2, compressed_s, next_step=9) is kept
    assert not trial.confirm_ready
    trial.observe(9, 5.0, 0.0)
    assert trial.compressed_s == [compressed_s] * 3  # judged: no more observations
    assert trial.uses_codec(8)  # the steps before the judgement stay as they ran
    assert trial.uses_codec(9) is kept and trial.uses_codec(100) is kept  # dropped: exact from step 9 on
    summary = trial.summary()
    assert summary["confirmed"] is kept and summary["measured_codec_step_s"] == compressed_s
    assert summary["dropped_step"] == (None if kept else 9)
    restored = CodecTrial(5, steps=3, margin=1.25)
    restored.load_state_dict(trial.state_dict())
    assert restored.summary() == summary and restored.uses_codec(20) is kept


def test_a_dropped_or_unconfirmed_codec_is_never_judged_and_confirm_steps_0_never_checks():
    never = _kept(confirm_steps=0)
    for step in range(5, 20):
        never.observe(step, 9.0, 0.0)
    assert not never.confirm_ready and never.uses_codec(19)
    dropped = CodecTrial(5, steps=3)
    _run(dropped, step_s=0.55, comm_wait_s=0.2, dry_run_s=0.2)
    assert not dropped.decide(*dropped.medians())
    for step in range(5, 20):
        dropped.observe(step, 0.5, 0.0)
    assert not dropped.confirm_ready and dropped.compressed_s == []
    with pytest.raises(ValueError, match="confirm_steps=-1"):
        CodecTrial(5, confirm_steps=-1)
    with pytest.raises(ValueError, match="confirmed='no'"):
        CodecTrial(5).load_state_dict({**never.state_dict(), "confirmed": "no"})


@pytest.mark.parametrize(("start", "steps", "margin", "message"), [
    (4, 3, 1.25, "start_step=4 must be >= 5"), (5, 1, 1.25, "auto_trial_steps=1"), (8, 3, 0.9, "auto_margin=0.9"),
])
def test_bad_settings_are_refused(start, steps, margin, message):
    with pytest.raises(ValueError, match=message):
        CodecTrial(start, steps=steps, margin=margin)
