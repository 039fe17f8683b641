"""The text a run decodes: each generated token counted, the text it adds, and why the output
ended (the end-of-sentence token, a stop string, the token limit)."""
from __future__ import annotations


def take_output(run, token_id: int, last: bool) -> str:
    """Count a generated token and say what text it adds; sets the finish reason when the
    output ends here (the end-of-sentence token, a stop string, the token limit)."""
    with run._lock:
        run._generated += 1
        run._generated_ids.append(int(token_id))
    out, piece = run._output, ""
    if run.stop_at_eos and token_id == run.eos_id:
        reason = "eos"
    else:
        if out is not None:
            piece, stopped = out.push(token_id)
            if stopped is not None:
                run._finish_reason = "stop"
                return piece
        reason = "length" if last else None
    if reason is not None:
        if out is not None:
            piece += out.finish()
        run._finish_reason = reason
    return piece
