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


@pytest.mark.parametrize(("start", "steps", "margin", "message"), [
    (4, 3, 1.25, "start_step=4 must be >= 5"), (5, 1, 1.25, "auto_trial_steps=1"), (8, 3, 0.9, "auto_margin=0.9"),
])
def test_bad_settings_are_refused(start, steps, margin, message):
    with pytest.raises(ValueError, match=message):
        CodecTrial(start, steps=steps, margin=margin)
