"""Graph passes (DESIGN §4): one module per pass, ordered and run by manager.py."""
from .manager import (DEFAULT_PIPELINE, PassContext, PassRecord, PassResult, Pipeline, get_pass,
                      make_context, register_pass, registered, resolve, run_pipeline)

__all__ = ["DEFAULT_PIPELINE", "PassContext", "PassRecord", "PassResult", "Pipeline", "get_pass",
           "make_context", "register_pass", "registered", "resolve", "run_pipeline"]
