"""The engine loop sends a request answered whole as two outputs (its first, then the rest
merged at its end), a streamed one or one with stop strings output by output, each with the
tokens of the engine's own outputs (lockstep/server/held_outputs.py)."""

from __future__ import annotations

import threading

from lockstep.config import EngineConfig
from lockstep.engine.engine import Engine
from lockstep.engine.sampling_params import SamplingParams
from lockstep.server.engine_loop import EngineLoop
from lockstep.server.engine_wire import AddRequests, Outputs, Reply, Stop


def test_requests_answered_whole_cross_as_two_outputs() -> None:
    engine = Engine(EngineConfig(model="random:tiny", device="cpu", kv_tokens=1024))
    events: list[object] = []
    done = threading.Event()

    def emit(event: object) -> None:
        events.append(event)
        if isinstance(event, Outputs) and any(o.finished for o in event.outputs):
            finished = {o.request_id for e in events if isinstance(e, Outputs)
                        for o in e.outputs if o.finished}  # fmt: skip
            if finished == {"whole", "streamed", "stops"}:
                done.set()

    loop = EngineLoop(engine, emit)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    stops = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=("zzz",))
    loop.post(AddRequests(1, [("whole", [3, 4, 5], params)], None, False))
    loop.post(AddRequests(2, [("streamed", [3, 4, 5], params)], None, True))
    loop.post(AddRequests(3, [("stops", [3, 4, 5], stops)], None, False))
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    assert done.wait(60)
    loop.post(Stop())
    thread.join(10)
    assert all(e.error is None for e in events if isinstance(e, Reply))
    sent: dict[str, list] = {}
    for event in events:
        if isinstance(event, Outputs):
            for out in event.outputs:
                sent.setdefault(out.request_id, []).append(out)
    assert [len(o.new_token_ids) for o in sent["whole"]] == [1, 11]
    assert len(sent["streamed"]) == len(sent["stops"]) == 12
    tokens = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in sent.items()}
    assert tokens["whole"] == tokens["streamed"] == tokens["stops"]  # same prompt, greedy
    whole = "".join(o.new_text for o in sent["whole"])
    assert whole == "".join(o.new_text for o in sent["streamed"]) and whole
