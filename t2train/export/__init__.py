"""The trained model outside the trainer: one process, any checkpoint.

``load.py`` rebuilds a checkpoint of any layout (TP, PP, DP; Megatron or DeepSpeed engine) as
one TP = PP = 1 model; ``hf.py`` writes it as a Hugging Face folder (``t2train export hf``),
``state_dict.py`` as one plain state dict (``t2train ckpt convert``), each into a folder of
``folders.py``; ``hf_import.py`` brings a Hugging Face model in (``t2train import hf``);
``generate.py`` samples from it and ``evaluate.py`` measures its loss on a prepared split
(``t2train generate``, ``t2train eval``); ``tokenizer.py`` finds the run's tokenizer.
Residual designs are reached through ``t2train.residual`` only.
"""
