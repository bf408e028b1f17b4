"""The HTTP routes by area: ``system`` (health, metrics, models), ``images`` (generations, edits), ``videos``,
``chat`` (vLLM-Omni's image route).

Each module holds one or two ``APIRouter``s; handlers find the shared state with ``current(request)``.
``build_app`` includes them in this order (the order of the OpenAPI paths).
"""
