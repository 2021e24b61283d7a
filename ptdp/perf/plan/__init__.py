"""The planner behind `ptdp plan`: the layouts that fit, ranked by simulated speed.

The search space from the paper's guidelines (`search`), the candidates bounded,
replayed and ranked, and the one to recommend among those the model cannot tell apart
(`ranking`), the reasons in the paper's terms (`explain`), the user's own layout placed
in the ranking (`compare`), and the config keys the command line pins (`keys`);
`planner` ties them together.
"""
