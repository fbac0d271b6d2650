"""agentd: a zero-trust runtime for multi-agent LLM systems.

What listener authors use is exported here; everything else is internal.
"""

from agentd._errors import AgentdError, ConfigError, HuhCode, Rejection, ValidationError
from agentd._handler import HandlerMetadata, HandlerResponse
from agentd._xmlify import MaxLen, XmlName, example_of, from_xml, to_xml, xmlify, xsd_of

__all__ = [
    "AgentdError",
    "ConfigError",
    "HandlerMetadata",
    "HandlerResponse",
    "HuhCode",
    "MaxLen",
    "Rejection",
    "ValidationError",
    "XmlName",
    "example_of",
    "from_xml",
    "to_xml",
    "xmlify",
    "xsd_of",
]

__version__ = "0.1.0"
