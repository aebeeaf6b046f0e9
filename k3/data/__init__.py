"""Data for training and serving alike: the byte-level BPE and tiktoken tokenizers (``tokenizer``), documents and
their split (``documents``), the built-in corpora (``corpus``) and user files (``files``) they come from, their
packing into rows (``packing``) of the shared batch form (``batch``), chat data (``chat``, ``sft``) and the embedded
vision-language task's batches (``vision``)."""
