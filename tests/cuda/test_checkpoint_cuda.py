"""A checkpoint of CUDA state, saved and restored: the resumed run takes the very steps the
uninterrupted one takes.

A checkpoint copies every tensor to the CPU before writing (``saver._copy``) and loads with
``map_location="cpu"``; restoring must put each one back where the live run keeps it: the
model's parameters and Adam's moments on the GPU (``load_state_dict`` copies into them), and
the session's error-feedback residuals on the device of the gradients they are added to.
One NCCL rank trains 4 steps with top-k and error feedback, saving after step 2; a second
model, optimizer and session resume from that checkpoint and train steps 3 and 4.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.cuda.common import CUDA, run_nccl

pytestmark = CUDA


def _resume(rank: int, world_size: int, root: str) -> dict:
    import poise
    from poise import config as cfg
    from poise.checkpoint import Checkpointer, capture, find_resume_point, load, restore
    from tests.cuda.workload import LENGTHS, Rows, collate, make_model, token_mean_loss

    device = torch.device("cuda", torch.cuda.current_device())
    config = cfg.from_dict({"out_dir": root, "task": {"name": "digits"},
                            "checkpoint": {"every_steps": 1, "async_save": False}})

    def parts() -> tuple:
        model = make_model(device)
        session = poise.Session(model, poise.Data(lengths=LENGTHS, loss_terms=LENGTHS, batch_size=8),
                                balance="cost", comm=poise.CommConfig(codec="topk", start_step=0))
        optimizer = torch.optim.Adam(session.model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        return model, session, optimizer, scheduler, session.dataloader(Rows(), collate_fn=collate)

    def train(session, optimizer, scheduler, loader, until: int, save=None) -> None:
        for step, (x, y) in session.steps(loader):
            step.backward(token_mean_loss(session.model, x.to(device), y.to(device)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if save is not None and step.index == 1:
                save()
            if step.index == until - 1:
                break

    model_a, session_a, opt_a, sched_a, loader_a = parts()
    saver = Checkpointer(config, rank=0, world_size=1, store=None, attempt=0, model=model_a)
    train(session_a, opt_a, sched_a, loader_a, 4, save=lambda: saver.save(capture(
        step=2, model=model_a, optimizer=opt_a, scheduler=sched_a, session=session_a, world_size=1)))
    saver.wait()

    model_b, session_b, opt_b, sched_b, loader_b = parts()
    x0, y0 = collate([Rows()[i] for i in range(4)])
    session_b.settle_buckets(lambda: token_mean_loss(session_b.model, x0.to(device), y0.to(device)).backward())
    name, manifest = find_resume_point(config, required=True)
    state = load(config, name, manifest, rank=0, world_size=1, model=model_b)
    restore(state, model=model_b, optimizer=opt_b, scheduler=sched_b, session=session_b)
    residuals = session_b.state_dict()["comm"]["codec"]["residuals"]
    moments = [t for s in opt_b.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    out = {"restored_step": session_b.steps_done, "name": name,
           "moments_on_device": bool(moments) and all(t.device == device for t in moments),
           "params_on_device": all(p.device == device for p in model_b.parameters()),
           "residuals": len(residuals)}
    train(session_b, opt_b, sched_b, loader_b, 4)
    out["a"] = [p.detach().cpu() for p in model_a.parameters()]
    out["b"] = [p.detach().cpu() for p in model_b.parameters()]
    out["residuals_on_device"] = all(r.device == device for r in session_b.state_dict()["comm"]["codec"]["residuals"]
                                     .values())
    session_a.finish()
    session_b.finish()
    return out


def test_a_resumed_cuda_run_takes_the_uninterrupted_runs_steps(tmp_path: Path):
    (r,) = run_nccl(_resume, world_size=1, timeout_s=180, root=str(tmp_path))
    assert r["restored_step"] == 2 and r["name"]
    assert r["params_on_device"] and r["moments_on_device"]
    assert r["residuals"] >= 1  # top-k's error feedback had residuals to restore
    assert r["residuals_on_device"]
    for a, b in zip(r["a"], r["b"], strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
