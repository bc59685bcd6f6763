"""titan-megamoe: a fused, communication-overlapping expert-parallel MoE operator for TorchTitan.

Data flows one way: the user's settings (``titan_megamoe.config``) -> the converter of
the installed TorchTitan -> layer -> operator (``titan_megamoe.ops``, one
``titan_megamoe.settings.OperatorSettings``) -> backends (``titan_megamoe.reference``,
``titan_megamoe.fused``) or TorchTitan's own path. What the TorchTitan adapters share
lives in ``titan_megamoe.job_settings`` (settings of a job) and
``titan_megamoe.expert_calls`` (what each call runs).

One adapter per TorchTitan release (``titan_megamoe.titan_version.ADAPTERS``):

- 0.2.2 loads the package through ``[job] custom_config_module = "titan_megamoe.config"``,
  and that import is the only hook it offers: so when TorchTitan is already loaded,
  importing the package imports the installed TorchTitan's adapter, which registers the
  ``mega_moe`` converter, the dataset and the flavors with it (``titan_megamoe.registry``);
- 0.3.0 takes ``titan_megamoe.torchtitan03.MegaMoEConverter.Config`` in a model's
  ``model_registry(flavor, converters=[...])``.

Without TorchTitan loaded the package imports nothing, so that
``from titan_megamoe.ops import mega_moe`` in a program without TorchTitan imports
neither TorchTitan nor Triton.
"""

import sys

if "torchtitan" in sys.modules:
    import importlib

    from titan_megamoe import titan_version

    importlib.import_module(titan_version.ADAPTERS[titan_version.installed_series()])
