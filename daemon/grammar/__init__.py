"""Constrained outputs: a request's ``Grammar`` (protocol/messages.py) compiled against the
model's vocabulary, and per request the tokens its grammar allows next.

Built on xgrammar: ``compiler.Grammars`` turns a grammar into xgrammar's compiled form (the
compiler caches by content), ``state.GrammarState`` holds one request's matcher. The
scheduler owns the states (scheduler/planner.py, outputs.py); the engine only applies the
masks a plan carries (engine/token_masks.py).

Invariants:
- a state is advanced by exactly the tokens its request commits, in order, once each;
- a constrained row is planned only when no step of its request is in flight, so its mask is
  computed from every token it has committed (under the overlap loop too; other rows keep
  overlapping), and a batch holding one does not draft;
- the mask lets a stop token (the model's end of sequence and the request's stop token ids)
  through only where the grammar may end.
"""
