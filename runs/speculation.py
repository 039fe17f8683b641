"""A run's speculative decoding (RunConfig.spec): the MTP layer's drafter set up on its session."""
from __future__ import annotations

from ds4f.engine.engine import Engine
from ds4f.engine.speculative import MtpDrafter, SpecController
from ds4f.errors import Ds4fError
from ds4f.units import format_bytes


def setup_spec(run, eng: Engine, session) -> None:
    """Speculative decoding for the run (RunConfig.spec): the MTP layer's drafter on the
    session, told every row from the prompt's first on. spec auto runs plainly where there is
    no MTP layer or sequences step together (start_run refuses a fixed k there)."""
    mode = run.config.spec
    if mode == "off":
        return
    if run.engines is not None and run.engines.parallel > 1:
        run._log("speculation: off while sequences step together")
        return
    try:
        layer = eng.mtp_layer()
    except Ds4fError as exc:
        if mode != "auto":
            raise
        run._log(f"speculation: off: {exc}")
        return
    session.enable_drafts(MtpDrafter(layer, session.context))
    run._spec = SpecController(mode)
    learned = eng.spec_learned        # what the runs before on this engine measured: auto starts there
    if mode == "auto" and learned is not None and not run.config.cold_start:   # (a cold start: afresh)
        run._spec.learn_from(learned)
        run._log(f"speculation: auto starts from the earlier runs' measurements on this engine (first"
                 f" drafts kept {int(learned.hits[1])} of {int(learned.tries[1])})")
    eng.spec_learned = run._spec
    with run._lock:
        run._lease.session_nbytes = session.nbytes
    run._log(f"speculation: {mode}" + (" (k chosen per round from what drafts save and cost)"
                                       if mode == "auto" else " drafts per round")
             + f"; the MTP layer's {format_bytes(eng.mtp_nbytes)} resident")
