"""Constrained outputs: a request's ``Grammar`` (protocol/messages.py), or its tools' calls
(the structural tag of the model's tool-call format), compiled against the model's
vocabulary, and per request the tokens its grammar allows next.

Built on xgrammar: ``compiler.Grammars`` turns a grammar into xgrammar's compiled form (the
compiler caches by content), ``queue.GrammarQueue`` compiles off the daemon's loop,
``state.GrammarState`` holds one request's matcher; ``tool_calls`` knows a model's tool-call
format (detected from its chat template; its answers are parsed by the client library's
outrider/protocol/tool_calls.py). The scheduler owns the
states (scheduler/planner.py, outputs.py); the engine only applies masks
(engine/token_masks.py).

NOTE: this package's ``__init__`` and ``tool_calls`` import neither torch nor xgrammar: the
HTTP front, a child process that must not import torch, reads ``tool_calls``.

Invariants:
- a state is advanced by exactly the tokens its request commits, in order, once each;
- a constrained row's mask is computed from every token it has committed: a plain decode
  step on one rank takes the row with its previous step in flight, and the loop fills the
  mask once that step is processed, while the new step's forward runs (late masks,
  scheduler/loop.py); elsewhere (a drafting step, tensor-parallel ranks) the row waits for its
  step while the other rows keep overlapping;
- under speculation every verify node is masked by the state its own path reaches: the host
  computes the nodes' masks once the step's drafts are copied back, while the device runs the
  verify's forward (``GrammarState.node_masks``). Such a step runs eagerly, so a batch
  holding a constrained row drafts only on one rank and without CUDA graphs
  (``SchedulerLimits.grammar_drafts``); a plain step with constrained rows replays a graph;
- drafts are proposed under the grammar too: a worker that drafts from logits masks each
  draft place by the state its path reaches (``DraftGuide``, ``GrammarState.path_mask``; the
  host waits for each place's path). n-gram drafts, copied from the context, are not: a draft
  the grammar refuses is rejected by the verify, which costs acceptance, never correctness;
- the mask lets a stop token (the model's end of sequence and the request's stop token ids)
  through only where the grammar may end.
"""
