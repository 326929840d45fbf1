"""Instant answers given a lane at a time (``service/http/turns.py``): a lane with many queued
waits its turn behind none of its own, and a job added during a turn joins before the next."""

from __future__ import annotations

import asyncio

from shardfeed.service.http.turns import Turns


def test_lanes_take_turns_and_late_arrivals_join_the_next_round():
    async def main():
        loop = asyncio.get_running_loop()
        turns, ran = Turns.of(loop), []
        assert Turns.of(loop) is turns

        def job(name: str, then=None):
            def run():
                ran.append(name)
                if then:
                    then()
            return run

        for n in range(1, 4):
            turns.add("heavy", job(f"heavy{n}", then=(lambda: turns.add("light", job("light2"))) if n == 1 else None))
        turns.add("light", job("light1"))
        for _ in range(20):
            await asyncio.sleep(0)
        return ran

    assert asyncio.run(main()) == ["heavy1", "light1", "heavy2", "light2", "heavy3"]
