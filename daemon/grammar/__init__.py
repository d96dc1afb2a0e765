"""Constrained outputs: a request's ``Grammar`` (protocol/messages.py), or its tools' calls
(the structural tag of the model's tool-call format), compiled against the model's
vocabulary, and per request the tokens its grammar allows next.

Built on xgrammar: ``compiler.Grammars`` turns a grammar into xgrammar's compiled form (the
compiler caches by content; ``schemas`` keeps the strings of its JSON schemas' grammars
strict JSON), ``queue.GrammarQueue`` compiles off the daemon's loop, ``child.CompileChild``
in a process of its own within time and memory limits (the daemon's),
``state.GrammarState`` holds one request's matcher; ``tool_calls`` knows a model's tool-call
format (detected from its chat template; its answers are parsed by the client library's
outrider/protocol/tool_calls.py); ``channels`` writes the harmony format's message stream
(gpt-oss: a chat's calls, or its final answer under the request's grammar, held; the
reasoning before them free). The scheduler owns the
states (scheduler/planner.py, outputs.py); the engine only applies masks
(engine/token_masks.py).

NOTE: this package's ``__init__`` and ``tool_calls`` import neither torch nor xgrammar: the
HTTP front, a child process that must not import torch, reads ``tool_calls``.

Invariants:
- a grammar that compiles past its limits, or whose masks take longer than
  ``--grammar-mask-limit-ms``, ends its request with ``invalid_request``: neither holds the
  other requests;
- a state is advanced by exactly the tokens its request commits, in order, once each;
- a constrained row's mask is computed from every token it has committed: on one rank a
  decode step takes the row with its previous step in flight, and the host computes the mask
  inside the new step once the loop has processed that step (late masks, scheduler/loop.py);
  on tensor-parallel ranks the row waits for its step while the other rows keep overlapping,
  and its mask travels in the plan;
- under speculation every verify node is masked by the state its own path reaches: the host
  computes the nodes' masks once the step's drafts are copied back
  (``GrammarState.node_masks``). A batch holding a constrained row drafts on one rank
  (``SchedulerLimits.grammar_drafts``; on tensor-parallel ranks it takes plain steps);
- drafts are proposed under the grammar too: a worker that drafts from logits masks each
  draft place by the state its path reaches (``DraftGuide``, ``GrammarState.place_masks``;
  the host waits for each place's path, copied before the forward of the place's logits
  where the worker runs one: ``DraftGuide.prepare``; where the worker hands over each
  place's best ids, DFlash's greedy block, the host chooses the places whose masked argmax
  is among them or alone in the mask, and waits only after one it could not tell:
  ``DraftGuide.candidates``; such a block guides its first places only, fewer in larger
  batches, and drafts the rest freely: ``DraftGuide.guided_places``), but not
  inside free text (a string:
  the mask allows most of the vocabulary), where a mask costs the most and the draft's own
  choice is almost always allowed: a place below one whose mask is free text takes none, a
  row whose committed state is free text masks only its first place in a step, and no
  place while free text goes on (nothing committed since that may leave it: a quotation
  mark or a backslash, ``Grammars.text_exits``; ``GrammarState.guides_paths``); a tree's
  depth masks its best places only (``GUIDED_PLACES``; its best alone in a step of more
  than two grammar rows: ``depth_guided``), none below the others; a depth whose places no
  row guides waits for nothing. n-gram drafts, copied from the context,
  are not guided. A draft the grammar refuses is rejected by the verify, which costs
  acceptance, never correctness;
- a step waits for the host only at ``MaskHoles`` waits (engine/token_masks.py), where a
  replayed graph is cut into segments;
- the mask lets a stop token (the model's end of sequence and the request's stop token ids)
  through only where the grammar may end;
- an output constrained by a JSON schema (or a tool's parameters) is strict JSON: no raw
  control character inside a string, length-bounded ones included (schemas.py).
"""
