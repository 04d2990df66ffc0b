"""Infrastructure every layer may use: atomic files and folders (``io``), run folders (``runs``),
data parallelism (``distributed``), recorded versions (``versions``) and plotting set-up."""
