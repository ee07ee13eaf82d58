"""Running the model: loading a checkpoint (``model_loader``), the model math (``models/``), one step's
forward pass over the paged KV cache (``model_runner``) and the sampling around the backends' kernels
(``sampler``)."""
