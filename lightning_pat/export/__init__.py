"""Writing and reading a shrunk model (floor 3, above the cut; no Lightning here).

``pretrained`` (``save_pretrained``/``load_pretrained``), its checks of a folder's files (``checks``), the pickle-free
module format (``module_tree``), the tokenizer beside an export (``tokenizer_files``), the serving formats
(``llama_layout``, ``decilm`` with its shipped ``decilm_config``, ``gguf``), and every ``from_pretrained`` the
library calls (``hf_loader``: ``trust_remote_code=False``).
"""

from lightning_pat.export.pretrained import load_pretrained, save_pretrained

__all__ = ["load_pretrained", "save_pretrained"]
