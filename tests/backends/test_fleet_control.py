"""The fleet control file: `add` and `retire K` lines are applied together; a line that cannot
be applied is named and left out."""

from jaxrl_async.backends import fleet_control


def test_adds_and_retires_are_read_together():
  assert fleet_control.parse("add\n# a comment\n\nretire 1\nadd\n", 2) == (2, [1], [])


def test_a_bad_line_is_named_and_left_out():
  adds, retires, problems = fleet_control.parse("retire 5\nretire x\ngrow\nretire 0\nretire 0",
                                                3)
  assert (adds, retires) == (0, [0])
  assert len(problems) == 4
  assert "servers 0 .. 2" in problems[0] and "already retired" in problems[3]
  assert "not 'add' or 'retire <server index>'" in problems[1]


def test_retiring_every_server_is_refused():
  adds, retires, problems = fleet_control.parse("retire 0", 1)
  assert (adds, retires) == (0, [])
  assert "would leave no rollout server" in problems[0]
  assert fleet_control.parse("retire 0\nadd", 1) == (1, [0], [])


def test_take_reads_and_removes_the_file(tmp_path):
  path = tmp_path / fleet_control.CONTROL_FILE
  assert fleet_control.take(str(path)) is None
  path.write_text("add\n")
  assert fleet_control.take(str(path)) == "add\n" and not path.exists()
