"""The reference engine (the ``torch`` extra): :class:`kvcache.engine.Engine`, which runs
Hugging Face models on kvcache blocks, its beam and sample families, the torch bridge
(``kvcache.torch``: views, block tables, paged attention) and beam search."""
