"""How a sequence's events (serving/scheduler.py: each token drawn, its end, a failure) cross from the model's
thread to the event loop that answers its request."""
import asyncio
import threading


class Mailbox:
    """Events put on the scheduler's thread, handed to the event loop in one wake-up for all those put before it
    runs, not one a token: each wake-up of the loop's thread takes a core from the model's OpenMP threads (16 bf16
    streams at the Llama-124M shape on 2 cores: 169.5 tokens/s with a wake-up an event, 219 with this; 233-238 with
    no HTTP at all)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.lock, self.pending, self.scheduled = loop, threading.Lock(), [], False

    def put(self, queue: asyncio.Queue, event) -> None:
        with self.lock:
            self.pending.append((queue, event))
            if self.scheduled:
                return
            self.scheduled = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self.lock:
            pending, self.pending, self.scheduled = self.pending, [], False
        for queue, event in pending:
            queue.put_nowait(event)


class Events:
    """A sequence's events, put by the scheduler's thread through the loop's mailbox, awaited on the loop."""

    def __init__(self, mailbox: Mailbox):
        self.mailbox, self.queue, self.next = mailbox, asyncio.Queue(), None

    def put(self, event) -> None:
        self.mailbox.put(self.queue, event)

    async def peek(self):
        """The next event, left for get()."""
        if self.next is None:
            self.next = await self.queue.get()
        return self.next

    async def get(self):
        event, self.next = self.next or await self.queue.get(), None
        return event
