#include <gtest/gtest.h>
TEST(Placeholder2, Builds) { EXPECT_EQ(1 + 1, 2); }
