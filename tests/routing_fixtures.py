"""Listeners for the semantic routing tests: file tools (read, list, erase), a
mailer, and an agent that speaks in intents. Each handler answers with what it
was asked, so a test sees which tool ran with which payload."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from agentd import HandlerMetadata, HandlerResponse, MaxLen, xmlify

NS = "https://example.org/ns/routing-test/"


@xmlify(namespace=NS + "read-file")
@dataclass
class ReadFile:
    """A file to read."""

    path: Annotated[str, MaxLen(256), "the file's path"]


@xmlify(namespace=NS + "list-files")
@dataclass
class ListFiles:
    """A directory to list."""

    directory: Annotated[str, MaxLen(256), "the directory"]


@xmlify(namespace=NS + "erase-files")
@dataclass
class EraseFiles:
    """Files to erase."""

    pattern: Annotated[str, MaxLen(256), "a glob of the files to erase"]


@xmlify(namespace=NS + "send-mail")
@dataclass
class SendMail:
    """A mail to send."""

    to: Annotated[str, MaxLen(256), "the recipient"]
    body: Annotated[str, MaxLen(4096), "the text"]


@xmlify(namespace=NS + "done")
@dataclass
class Done:
    """What a tool did."""

    handler: Annotated[str, MaxLen(64), "the tool that ran"]
    detail: Annotated[str, MaxLen(4096), "its input"]


@xmlify(namespace=NS + "worker-task")
@dataclass
class WorkerTask:
    """A task for the worker agent."""

    text: Annotated[str, MaxLen(4096), "the task"]


async def read_file(payload: ReadFile, meta: HandlerMetadata) -> HandlerResponse:
    return HandlerResponse.respond(Done(handler="files.read", detail=payload.path))


async def list_files(payload: ListFiles, meta: HandlerMetadata) -> HandlerResponse:
    return HandlerResponse.respond(Done(handler="files.list", detail=payload.directory))


async def erase_files(payload: EraseFiles, meta: HandlerMetadata) -> HandlerResponse:
    return HandlerResponse.respond(Done(handler="files.erase", detail=payload.pattern))


async def send_mail(payload: SendMail, meta: HandlerMetadata) -> HandlerResponse:
    return HandlerResponse.respond(Done(handler="mail.send", detail=payload.to))
