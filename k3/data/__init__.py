"""Data for training and serving alike: the byte-level BPE and tiktoken tokenizers (``tokenizer``), text corpora
packed into rows (``packing``) and the embedded vision-language task's batches (``vision``)."""
